"""Every deployment gets its own engine key (the bearer token its replicas demand); the
deployments made before get one each here, not one shared default.

Their replicas were started without a key and would keep answering anyone, so each
deployment that runs replicas (local, kubernetes) gets a new generation: the reconciler
rolls its replicas over to keyed ones the usual way (a new one ready before an old one
drains), so nothing stops serving. External endpoints have their own keys."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

import controlplane.models


def give_each_a_key(apps: Any, schema_editor: Any) -> None:
    Deployment = apps.get_model("controlplane", "Deployment")
    for deployment in Deployment.objects.filter(engine_key_sealed="").select_related(
            "backend"):
        deployment.engine_key_sealed = controlplane.models.sealed_engine_key()
        fields = ["engine_key_sealed"]
        if deployment.backend.kind != "external":
            deployment.generation += 1
            fields.append("generation")
        deployment.save(update_fields=fields)


class Migration(migrations.Migration):
    dependencies = [("controlplane", "0005_role_groups")]

    operations = [
        migrations.AddField(model_name="deployment", name="engine_key_sealed",
                            field=models.TextField(default="", editable=False)),
        migrations.RunPython(give_each_a_key, migrations.RunPython.noop),
        migrations.AlterField(model_name="deployment", name="engine_key_sealed",
                              field=models.TextField(
                                  default=controlplane.models.sealed_engine_key,
                                  editable=False)),
    ]
