"""The three roles as groups (controlplane/roles.py)."""

from typing import Any

from django.db import migrations

ROLES = ("viewer", "operator", "admin")


def create(apps: Any, schema_editor: Any) -> None:
    group = apps.get_model("auth", "Group")
    for name in ROLES:
        group.objects.get_or_create(name=name)


def remove(apps: Any, schema_editor: Any) -> None:
    apps.get_model("auth", "Group").objects.filter(name__in=ROLES).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("controlplane", "0004_deployment_admission"),
    ]

    operations = [migrations.RunPython(create, remove)]
