from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('serving', '0005_usage_request_id_fits_the_gateway'),
    ]

    operations = [
        migrations.AddField(
            model_name='usagerecord',
            name='record_id',
            field=models.CharField(blank=True, editable=False, max_length=32, null=True,
                                   unique=True),
        ),
    ]
