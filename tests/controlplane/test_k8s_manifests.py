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


def of_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [found] = [o for o in objects if o["kind"] == kind]
    return found


@pytest.fixture
def deployment() -> Any:
    model = make_model("llama-8b", source="huggingface",
                       source_uri="meta-llama/Llama-3.1-8B-Instruct")
    return make_deployment("chat", model=model, replicas=3, min_replicas=1, max_replicas=6,
                           engine_args={"max_model_len": 8192, "tensor_parallel_size": 2,
                                        "served_model_name": "llama"})


def test_the_deployment_service_and_budget_validate(deployment: Any, settings: Any) -> None:
    settings.KUBERNETES_ALLOWED_SERVICE_ACCOUNTS = ["vllm"]
    assert kubernetes_validate.latest_version().startswith("1.37")
    config = KubernetesConfig.from_dict({
        "namespace": "inference", "gpu_product": "NVIDIA-H100-80GB-HBM3",
        "hf_token_secret": "hf-token", "image_tag": "v0.11.0",
        "image_pull_secrets": ["registry"], "service_account": "vllm"})
    objects = render(deployment, config)
    validate(objects)
    kinds = [o["kind"] for o in objects]
    assert kinds == ["Secret", "Deployment", "Service", "PodDisruptionBudget",
                     "NetworkPolicy"]
    apps = of_kind(objects, "Deployment")
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
    assert of_kind(objects, "Service")["spec"]["clusterIP"] == "None"  # pods are endpoints


def test_models_from_a_volume_claim_or_a_host_path(deployment: Any, settings: Any) -> None:
    settings.KUBERNETES_ALLOWED_HOST_PATHS = ["/mnt/models"]
    for raw, volume in (({"namespace": "a", "model_source": "pvc", "pvc_name": "models"},
                         "persistentVolumeClaim"),
                        ({"namespace": "a", "model_source": "hostPath",
                          "host_path": "/mnt/models"}, "hostPath")):
        objects = render(deployment, KubernetesConfig.from_dict(raw))
        validate(objects)
        pod = of_kind(objects, "Deployment")["spec"]["template"]["spec"]
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
    assert "replicas" not in of_kind(render(deployment, config, "hpa"), "Deployment")["spec"]
    native = KubernetesConfig.from_dict({"namespace": "inference", "scaling": "keda"})
    assert render(deployment, native)[-1]["kind"] == "ScaledObject"
    # Stopped: no autoscaler may bring pods back, and the count is zero.
    deployment.state = "stopped"
    stopped = render(deployment, native)
    assert [o["kind"] for o in stopped] == ["Secret", "Deployment", "Service",
                                            "PodDisruptionBudget", "NetworkPolicy"]
    assert of_kind(stopped, "Deployment")["spec"]["replicas"] == 0


def test_the_pod_template_carries_the_generation_and_a_role(deployment: Any) -> None:
    config = KubernetesConfig.from_dict({"namespace": "inference"})
    deployment.standby = 1
    apps = of_kind(render(deployment, config), "Deployment")
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
    assert [o["kind"] for o in objects] == ["Secret", "Deployment", "Service",
                                            "PodDisruptionBudget", "NetworkPolicy"]
    validate(objects)
    with pytest.raises(CommandError, match="give a kubernetes configuration"):
        call_command("render_manifests", "chat", stdout=io.StringIO())
    with pytest.raises(CommandError, match="no deployment named 'nope'"):
        call_command("render_manifests", "nope", stdout=io.StringIO())
    with pytest.raises(CommandError, match="namespace: required"):
        call_command("render_manifests", "chat", "--config", "{}", stdout=io.StringIO())


def test_pods_run_without_a_token_privilege_escalation_or_capabilities(
        deployment: Any) -> None:
    objects = render(deployment, KubernetesConfig.from_dict({"namespace": "inference"}))
    pod = of_kind(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [container] = pod["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_the_pods_read_their_engine_key_from_the_deployments_secret(deployment: Any) -> None:
    import base64

    objects = render(deployment, KubernetesConfig.from_dict({"namespace": "inference"}))
    secret = of_kind(objects, "Secret")
    assert objects.index(secret) == 0  # applied before any pod needs it
    assert secret["metadata"]["name"] == "chat-engine-key"
    assert secret["metadata"]["labels"][ID_LABEL] == str(deployment.pk)
    key = base64.b64decode(secret["data"]["VLLM_API_KEY"]).decode()
    assert key == deployment.engine_key()
    [container] = of_kind(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "chat-engine-key", "key": "VLLM_API_KEY"}}} in container["env"]
    assert not any(key in arg for arg in container["args"])


def test_the_network_policy_admits_only_the_gateway_and_the_controllers(
        deployment: Any, settings: Any) -> None:
    config = KubernetesConfig.from_dict({"namespace": "inference"})
    policy = of_kind(render(deployment, config), "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == owner_labels(deployment)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert [(p["namespaceSelector"]["matchLabels"], p["podSelector"]["matchLabels"])
            for p in rule["from"]] == [
        ({"kubernetes.io/metadata.name": "fleetplane"},
         {"app.kubernetes.io/name": "fleetplane", "app.kubernetes.io/component": "gateway"}),
        ({"kubernetes.io/metadata.name": "fleetplane"},
         {"app.kubernetes.io/name": "fleetplane",
          "app.kubernetes.io/component": "controller"})]
    settings.KUBERNETES_PROMETHEUS_POD_LABELS = {"app.kubernetes.io/name": "prometheus"}
    with_prometheus = of_kind(render(deployment, config), "NetworkPolicy")
    validate([with_prometheus])
    assert with_prometheus["spec"]["ingress"][0]["from"][-1] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_render_manifests_never_prints_the_engine_key(deployment: Any) -> None:
    out = io.StringIO()
    call_command("render_manifests", "chat", "--config", '{"namespace": "inference"}',
                 stdout=out)
    assert deployment.engine_key() not in out.getvalue()
    import base64

    assert base64.b64encode(deployment.engine_key().encode()).decode() not in out.getvalue()


@pytest.mark.parametrize(("raw", "field"), [
    ({"namespace": "a", "image": "attacker/miner"}, "image"),
    ({"namespace": "a", "image": "vllm/vllm-openai-evil"}, "image"),
    ({"namespace": "a", "model_source": "hostPath", "host_path": "/"}, "host_path"),
    ({"namespace": "a", "model_source": "hostPath", "host_path": "/etc"}, "host_path"),
    ({"namespace": "a", "model_source": "hostPath", "host_path": "/mnt/models/../../etc"},
     "host_path"),
    ({"namespace": "a", "model_source": "hostPath", "host_path": "/mnt/models-other"},
     "host_path"),
    ({"namespace": "a", "service_account": "cluster-admin"}, "service_account"),
])
def test_a_kubernetes_backend_may_name_only_what_the_install_allows(
        admin_client: Any, settings: Any, raw: dict[str, Any], field: str) -> None:
    settings.KUBERNETES_ALLOWED_HOST_PATHS = ["/mnt/models"]
    response = admin_client.post("/api/v1/backends/", {
        "name": "gpus", "kind": "kubernetes", "config": raw}, format="json")
    assert response.status_code == 400, response.json()
    assert field in str(response.json())


def test_images_paths_and_accounts_the_install_lists_are_accepted(
        admin_client: Any, settings: Any) -> None:
    settings.KUBERNETES_ALLOWED_IMAGES = ["registry.example/vllm", "vllm/vllm-openai:v0.11.0"]
    settings.KUBERNETES_ALLOWED_HOST_PATHS = ["/mnt/models"]
    settings.KUBERNETES_ALLOWED_SERVICE_ACCOUNTS = ["vllm"]
    for name, raw in (
            ("any-tag", {"image": "registry.example/vllm", "image_tag": "2026-11"}),
            ("one-tag", {"image": "vllm/vllm-openai", "image_tag": "v0.11.0"}),
            ("mounted", {"image": "registry.example/vllm", "model_source": "hostPath",
                         "host_path": "/mnt/models/llama"}),
            ("account", {"image": "registry.example/vllm", "service_account": "vllm"})):
        response = admin_client.post("/api/v1/backends/", {
            "name": name, "kind": "kubernetes", "config": {"namespace": "a", **raw}},
            format="json")
        assert response.status_code == 201, (name, response.json())
    refused = admin_client.post("/api/v1/backends/", {
        "name": "other-tag", "kind": "kubernetes", "config": {
            "namespace": "a", "image": "vllm/vllm-openai", "image_tag": "latest"}},
        format="json")
    assert refused.status_code == 400
