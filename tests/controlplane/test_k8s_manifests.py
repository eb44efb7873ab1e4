"""The Kubernetes backend's manifests, validated against the real Kubernetes OpenAPI
schemas of the two newest minor versions kubernetes-validate ships (strict: unknown fields
are errors). No API server runs here; these check what would be sent to one."""

from __future__ import annotations

import io
from typing import Any

import kubernetes_validate
import pytest
import yaml
from django.core.management import CommandError, call_command

from controlplane.backends.base import BackendConfigError
from controlplane.backends.k8s_manifests import (
    ID_LABEL,
    KubernetesConfig,
    owner_labels,
    render,
)
from tests.factories import make_deployment, make_model

pytestmark = pytest.mark.django_db

VERSIONS = ("1.36.0", "1.37.0")



def validate(objects: list[dict[str, Any]]) -> None:
    for version in VERSIONS:
        for obj in objects:
            if obj["apiVersion"].startswith("keda.sh/"):
                continue  # a custom resource: not in Kubernetes' own schemas
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.fixture
def deployment() -> Any:
    model = make_model("llama-8b", source="huggingface",
                       source_uri="meta-llama/Llama-3.1-8B-Instruct")
    return make_deployment("chat", model=model, replicas=3, min_replicas=1, max_replicas=6,
                           engine_args={"max_model_len": 8192, "tensor_parallel_size": 2,
                                        "served_model_name": "llama"})


def test_the_deployment_service_and_budget_validate(deployment: Any) -> None:
    assert kubernetes_validate.latest_version().startswith("1.37")
    config = KubernetesConfig.from_dict({
        "namespace": "inference", "gpu_product": "NVIDIA-H100-80GB-HBM3",
        "hf_token_secret": "hf-token", "image_tag": "v0.11.0",
        "image_pull_secrets": ["registry"], "service_account": "vllm"})
    objects = render(deployment, config)
    validate(objects)
    kinds = [o["kind"] for o in objects]
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget"]
    apps = objects[0]
    assert apps["spec"]["replicas"] == 3
    pod = apps["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "vllm/vllm-openai:v0.11.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    args = container["args"]
    assert args[args.index("--model") + 1] == "meta-llama/Llama-3.1-8B-Instruct"
    assert args[args.index("--served-model-name") + 1] == "llama"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "hf-token", "key": "HF_TOKEN"}}} in container["env"]
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [
        "NVIDIA-H100-80GB-HBM3"]
    assert container["startupProbe"]["failureThreshold"] * 10 >= 1800
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "fleetplane"
        assert labels[ID_LABEL] == str(deployment.pk)
        assert obj["metadata"]["namespace"] == "inference"
    assert objects[1]["spec"]["clusterIP"] == "None"  # headless: pods are the endpoints


def test_models_from_a_volume_claim_or_a_host_path(deployment: Any) -> None:
    for raw, volume in (({"namespace": "a", "model_source": "pvc", "pvc_name": "models"},
                         "persistentVolumeClaim"),
                        ({"namespace": "a", "model_source": "hostPath",
                          "host_path": "/mnt/models"}, "hostPath")):
        objects = render(deployment, KubernetesConfig.from_dict(raw))
        validate(objects)
        pod = objects[0]["spec"]["template"]["spec"]
        assert volume in pod["volumes"][1]
        args = pod["containers"][0]["args"]
        assert args[args.index("--model") + 1] == "/models/llama-8b"


def test_native_scaling_adds_an_autoscaler(deployment: Any) -> None:
    config = KubernetesConfig.from_dict({"namespace": "inference"})
    [*_, hpa] = render(deployment, config, "hpa")
    validate([hpa])
    assert hpa["kind"] == "HorizontalPodAutoscaler"
    assert hpa["spec"]["minReplicas"] == 1 and hpa["spec"]["maxReplicas"] == 6
    [*_, keda] = render(deployment, config, "keda")
    assert keda["kind"] == "ScaledObject"
    assert "vllm:num_requests_waiting" in keda["spec"]["triggers"][0]["metadata"]["query"]
    # The autoscaler owns the count: applying it must not fight over spec.replicas.
    assert "replicas" not in render(deployment, config, "hpa")[0]["spec"]
    native = KubernetesConfig.from_dict({"namespace": "inference", "scaling": "keda"})
    assert render(deployment, native)[-1]["kind"] == "ScaledObject"
    # Stopped: no autoscaler may bring pods back, and the count is zero.
    deployment.state = "stopped"
    stopped = render(deployment, native)
    assert [o["kind"] for o in stopped] == ["Deployment", "Service", "PodDisruptionBudget"]
    assert stopped[0]["spec"]["replicas"] == 0


def test_the_pod_template_carries_the_generation_and_a_role(deployment: Any) -> None:
    config = KubernetesConfig.from_dict({"namespace": "inference"})
    deployment.standby = 1
    [apps, *_] = render(deployment, config)
    assert apps["spec"]["replicas"] == 4  # three active and one warm standby
    template = apps["spec"]["template"]["metadata"]
    assert template["labels"]["fleetplane.io/role"] == "active"
    assert template["annotations"]["fleetplane.io/generation"] == str(deployment.generation)
    assert "fleetplane.io/role" not in apps["spec"]["selector"]["matchLabels"]


def test_a_configuration_is_accepted_through_the_api_check_and_kept_whole() -> None:
    from controlplane.backends.base import validate_backend_config

    stored = validate_backend_config("kubernetes", {"namespace": "inference",
                                                    "gpu_product": "NVIDIA-H200"})
    assert stored["namespace"] == "inference" and stored["scaling"] == "controlplane"
    assert KubernetesConfig.from_dict(stored) == KubernetesConfig.from_dict(
        {"namespace": "inference", "gpu_product": "NVIDIA-H200"})


def test_the_same_inputs_give_the_same_manifests(deployment: Any) -> None:
    config = KubernetesConfig.from_dict({"namespace": "inference"})
    assert render(deployment, config) == render(deployment, config)
    assert owner_labels(deployment)["app.kubernetes.io/instance"] == "chat"


@pytest.mark.parametrize(("raw", "field"), [
    ({}, "namespace"),
    ({"namespace": "Not_A_Label"}, "namespace"),
    ({"namespace": "a", "colour": "red"}, "colour"),
    ({"namespace": "a", "model_source": "s3"}, "model_source"),
    ({"namespace": "a", "model_source": "pvc"}, "pvc_name"),
    ({"namespace": "a", "model_source": "hostPath", "host_path": "models"}, "host_path"),
    ({"namespace": "a", "memory": "lots"}, "memory"),
    ({"namespace": "a", "startup_seconds": 5}, "startup_seconds"),
    ({"namespace": "a", "image_pull_secrets": "registry"}, "image_pull_secrets"),
    ({"namespace": "a", "scaling": "magic"}, "scaling"),
    ({"namespace": "a", "warm_up": "yes"}, "warm_up"),
])
def test_bad_configuration_names_the_setting(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(BackendConfigError) as caught:
        KubernetesConfig.from_dict(raw)
    assert caught.value.field == field


def test_a_model_that_is_not_a_hub_id_cannot_be_downloaded_by_pods() -> None:
    model = make_model("local-one", source="local", source_uri="/data/models/x")
    deployment = make_deployment("local-dep", model=model)
    with pytest.raises(BackendConfigError, match="not a Hugging Face id"):
        render(deployment, KubernetesConfig.from_dict({"namespace": "a"}))


def test_render_manifests_prints_yaml_that_validates(deployment: Any) -> None:
    out = io.StringIO()
    call_command("render_manifests", "chat", "--config", '{"namespace": "inference"}',
                 stdout=out)
    objects = [o for o in yaml.safe_load_all(out.getvalue()) if o]
    assert [o["kind"] for o in objects] == ["Deployment", "Service", "PodDisruptionBudget"]
    validate(objects)
    with pytest.raises(CommandError, match="give a kubernetes configuration"):
        call_command("render_manifests", "chat", stdout=io.StringIO())
    with pytest.raises(CommandError, match="no deployment named 'nope'"):
        call_command("render_manifests", "nope", stdout=io.StringIO())
    with pytest.raises(CommandError, match="namespace: required"):
        call_command("render_manifests", "chat", "--config", "{}", stdout=io.StringIO())
