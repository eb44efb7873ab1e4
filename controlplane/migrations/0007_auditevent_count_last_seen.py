"""Repeated events become one row with a count and the time last seen: the columns, each
existing row seen once at its own time, and the indexes the coalescing lookup, the newest-first
lists and the retention sweep read."""

from __future__ import annotations

from django.db import migrations, models
from django.db.models import F
from django.utils import timezone


def seen_when_written(apps: object, schema_editor: object) -> None:
    AuditEvent = apps.get_model("controlplane", "AuditEvent")  # type: ignore[attr-defined]
    AuditEvent.objects.update(last_seen=F("at"))


class Migration(migrations.Migration):
    dependencies = [("controlplane", "0006_deployment_engine_key")]

    operations = [
        migrations.AddField(model_name="auditevent", name="count",
                            field=models.PositiveIntegerField(default=1)),
        migrations.AddField(model_name="auditevent", name="key",
                            field=models.CharField(blank=True, default="", editable=False,
                                                   max_length=64)),
        migrations.AddField(model_name="auditevent", name="last_seen",
                            field=models.DateTimeField(default=timezone.now)),
        migrations.RunPython(seen_when_written, migrations.RunPython.noop),
        migrations.AlterModelOptions(name="auditevent",
                                     options={"ordering": ["-last_seen", "-id"]}),
        migrations.AddIndex(model_name="auditevent", index=models.Index(
            fields=["key", "last_seen"], name="auditevent_key_seen")),
        migrations.AddIndex(model_name="auditevent", index=models.Index(
            fields=["-last_seen", "-id"], name="auditevent_seen")),
        migrations.AddIndex(model_name="auditevent", index=models.Index(
            fields=["deployment", "-last_seen", "-id"], name="auditevent_deployment_seen")),
    ]
