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
    INSTALL_LABEL,
    INSTANCE_LABEL,
    KubernetesConfig,
    object_name,
    owner_labels,
    render,
    selector_changed,
)
from tests.factories import make_deployment, make_model

pytestmark = pytest.mark.django_db

VERSIONS = ("1.36.0", "1.37.0")



CUSTOM_RESOURCES = ("keda.sh/", "monitoring.coreos.com/")


def validate(objects: list[dict[str, Any]]) -> None:
    for version in VERSIONS:
        for obj in objects:
            if obj["apiVersion"].startswith(CUSTOM_RESOURCES):
                continue  # custom resources: not in Kubernetes' own schemas (checked by hand)
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
        assert labels[INSTALL_LABEL] == "fleetplane"
        assert labels[INSTANCE_LABEL] == "chat"
        assert str(deployment.pk) not in labels.values()
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
    assert secret["metadata"]["labels"] == owner_labels(deployment)
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


# --- names and selectors -----------------------------------------------------------------

DNS_1035 = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"
LABEL_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?"


@pytest.mark.parametrize("name", ["8b-chat", "My_Chat", "x" * 63, "7", "a--b_"])
def test_every_object_gets_a_name_its_kind_accepts(name: str) -> None:
    import re

    deployment = make_deployment(name, model=make_model(
        "hub", source="huggingface", source_uri="org/model"))
    objects = render(deployment, KubernetesConfig.from_dict({"namespace": "inference"}))
    validate(objects)
    base = object_name(name)
    assert re.fullmatch(DNS_1035, base), base  # what a Service needs
    assert {o["metadata"]["name"] for o in objects} == {base, f"{base}-engine-key"}
    for obj in objects:
        for value in obj["metadata"]["labels"].values():
            assert re.fullmatch(LABEL_VALUE, value), value
    assert object_name(name) == base  # the same name always gives the same result


def test_a_name_that_fits_is_kept_and_one_that_does_not_is_changed_as_documented() -> None:
    assert object_name("chat") == "chat"
    assert object_name("8b-chat").startswith("d-8b-chat-")
    assert len(object_name("8b-chat")) == len("d-8b-chat-") + 8
    assert object_name("8b-chat") != object_name("8B-chat")  # never two names in one
    assert len(object_name("x" * 63)) == 63


def test_selectors_are_the_name_and_the_install_not_the_database_id(
        deployment: Any) -> None:
    config = KubernetesConfig.from_dict({"namespace": "inference"})
    before = of_kind(render(deployment, config), "Deployment")
    assert before["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "chat",
        "app.kubernetes.io/managed-by": "fleetplane", "fleetplane.io/install": "fleetplane"}
    # The database rebuilt: the same deployment, another id, the same selector and pods.
    model, args, backend = deployment.model, deployment.engine_args, deployment.backend
    deployment.delete()
    again = make_deployment("chat", model=model, backend=backend, replicas=3,
                            min_replicas=1, max_replicas=6, engine_args=args)
    after = of_kind(render(again, config), "Deployment")
    assert again.pk != deployment.pk
    assert after["spec"]["selector"] == before["spec"]["selector"]
    assert after["spec"]["template"] == before["spec"]["template"]


def test_another_install_in_the_namespace_names_and_selects_apart(
        deployment: Any, settings: Any) -> None:
    config = KubernetesConfig.from_dict({"namespace": "inference"})
    ours = render(deployment, config)
    settings.INSTALL_ID = "staging"
    theirs = render(deployment, config)
    validate(theirs)
    assert of_kind(theirs, "Deployment")["metadata"]["name"] == "staging-chat"
    assert of_kind(theirs, "Secret")["metadata"]["name"] == "staging-chat-engine-key"
    selector = of_kind(theirs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert selector["fleetplane.io/install"] == "staging"
    for obj in ours:  # the other install's selector matches none of ours
        labels = obj["metadata"]["labels"]
        assert any(labels.get(key) != value for key, value in selector.items())


def test_a_deployment_applied_with_an_older_selector_is_told_apart(deployment: Any) -> None:
    config = KubernetesConfig.from_dict({"namespace": "inference"})
    rendered = of_kind(render(deployment, config), "Deployment")
    legacy = {"kind": "Deployment", "spec": {"selector": {"matchLabels": {
        "app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "chat",
        "app.kubernetes.io/managed-by": "fleetplane", "fleetplane.io/deployment-id": "7"}}}}
    assert selector_changed(legacy, rendered)
    assert not selector_changed(rendered, rendered)
    assert not selector_changed(of_kind(render(deployment, config), "Service"), rendered)


# --- pods that survive production ----------------------------------------------------------

def pod_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(of_kind(objects, "Deployment")["spec"]["template"]["spec"])


def test_resources_grow_with_the_gpus_a_pod_uses() -> None:
    model = make_model("big", source="huggingface", source_uri="org/big")
    deployment = make_deployment("big", model=model, engine_args={
        "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
        "extra_args": ["--cpu-offload-gb", "10"]})
    config = KubernetesConfig.from_dict({"namespace": "inference"})
    objects = render(deployment, config)
    validate(objects)
    pod = pod_of(objects)
    [container] = pod["containers"]
    # 4 GPUs: 4 x 4 CPUs; 4 x 16Gi, plus 4 x 2Gi of /dev/shm, plus 4 x 10Gi offloaded.
    assert container["resources"]["limits"] == {"cpu": "16", "memory": "112Gi",
                                                "nvidia.com/gpu": "4"}
    assert container["resources"]["requests"]["memory"] == "112Gi"
    assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    args = container["args"]
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    one = render(make_deployment("small", model=model, backend=deployment.backend),
                 KubernetesConfig.from_dict({"namespace": "inference"}))
    assert pod_of(one)["containers"][0]["resources"]["limits"] == {
        "cpu": "4", "memory": "18Gi", "nvidia.com/gpu": "1"}


def test_sizes_set_for_the_whole_pod_are_kept(deployment: Any) -> None:
    config = KubernetesConfig.from_dict({"namespace": "inference", "cpu": "6",
                                         "memory": "20Gi", "shm_size": "1536Mi",
                                         "cpu_per_gpu": "500m"})
    pod = pod_of(render(deployment, config))
    assert pod["containers"][0]["resources"]["limits"]["cpu"] == "6"
    assert pod["containers"][0]["resources"]["limits"]["memory"] == "22016Mi"  # + /dev/shm
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "1536Mi"
    halves = KubernetesConfig.from_dict({"namespace": "inference", "cpu_per_gpu": "500m",
                                         "memory_per_gpu": "1.5Gi"})
    limits = pod_of(render(deployment, halves))["containers"][0]["resources"]["limits"]
    assert limits["cpu"] == "1" and limits["memory"] == "7Gi"  # 2 GPUs


def test_more_gpus_than_a_node_has_are_refused_naming_both_numbers() -> None:
    model = make_model("huge", source="huggingface", source_uri="org/huge")
    deployment = make_deployment("huge", model=model, engine_args={
        "tensor_parallel_size": 8, "pipeline_parallel_size": 2})
    with pytest.raises(BackendConfigError) as refused:
        render(deployment, KubernetesConfig.from_dict({"namespace": "inference"}))
    assert refused.value.field == "engine_args.tensor_parallel_size"
    assert "= 16 GPUs, more than the 8 a node has" in refused.value.message
    wide = KubernetesConfig.from_dict({"namespace": "inference", "gpus_per_node": 16})
    assert pod_of(render(deployment, wide))["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == "16"


def test_a_busy_engine_is_not_pulled_from_service_or_restarted_at_once(
        deployment: Any) -> None:
    [container] = pod_of(render(deployment, KubernetesConfig.from_dict(
        {"namespace": "inference"})))["containers"]
    ready, alive = container["readinessProbe"], container["livenessProbe"]
    assert ready["timeoutSeconds"] >= 5 and ready["failureThreshold"] >= 3
    assert alive["timeoutSeconds"] > ready["timeoutSeconds"]
    assert alive["periodSeconds"] * alive["failureThreshold"] > \
        ready["periodSeconds"] * ready["failureThreshold"]


def test_in_flight_requests_finish_within_the_grace_period(deployment: Any) -> None:
    pod = pod_of(render(deployment, KubernetesConfig.from_dict({"namespace": "inference"})))
    [container] = pod["containers"]
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    args = container["args"]
    drain = int(args[args.index("--shutdown-timeout") + 1])
    assert (pause, drain, pod["terminationGracePeriodSeconds"]) == (30, 80, 120)
    short = pod_of(render(deployment, KubernetesConfig.from_dict({
        "namespace": "inference", "termination_grace_seconds": 20,
        "drain_on_sigterm": False})))
    assert "--shutdown-timeout" not in short["containers"][0]["args"]
    assert short["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] == 5


def test_volumes_with_weights_are_mounted_read_only_and_downloads_are_sized(
        deployment: Any, settings: Any) -> None:
    settings.KUBERNETES_ALLOWED_HOST_PATHS = ["/mnt/models"]
    for raw in ({"model_source": "pvc", "pvc_name": "models"},
                {"model_source": "hostPath", "host_path": "/mnt/models"}):
        pod = pod_of(render(deployment, KubernetesConfig.from_dict(
            {"namespace": "a", **raw})))
        assert pod["containers"][0]["volumeMounts"][1] == {
            "name": "models", "mountPath": "/models", "readOnly": True}
    claim = pod_of(render(deployment, KubernetesConfig.from_dict(
        {"namespace": "a", "model_source": "pvc", "pvc_name": "models"})))["volumes"][1]
    assert claim["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    downloaded = render(deployment, KubernetesConfig.from_dict({"namespace": "a"}))
    validate(downloaded)
    pod = pod_of(downloaded)
    assert pod["volumes"][1] == {"name": "models", "emptyDir": {"sizeLimit": "100Gi"}}
    assert pod["containers"][0]["volumeMounts"][1]["readOnly"] is False
    assert pod["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "100Gi"
    settings.KUBERNETES_ALLOWED_CACHE_CLAIMS = ["hf-cache"]
    kept = render(deployment, KubernetesConfig.from_dict(
        {"namespace": "a", "download_cache_pvc": "hf-cache"}))
    validate(kept)
    assert pod_of(kept)["volumes"][1] == {"name": "models", "persistentVolumeClaim": {
        "claimName": "hf-cache"}}
    assert "ephemeral-storage" not in pod_of(kept)["containers"][0]["resources"]["requests"]


def test_the_image_is_pinned_and_latest_is_refused(deployment: Any) -> None:
    from controlplane.backends.k8s_manifests import check_allowed

    config = KubernetesConfig.from_dict({"namespace": "a"})
    assert pod_of(render(deployment, config))["containers"][0]["image"] == \
        "vllm/vllm-openai:v0.32.0"
    with pytest.raises(BackendConfigError, match="`latest` is not pinned") as refused:
        KubernetesConfig.from_dict({"namespace": "a", "image_tag": "latest"})
    assert refused.value.field == "image_tag"
    # Stored before the refusal: the backend loads, and its apply says what to change.
    stored = KubernetesConfig.from_dict({"namespace": "a", "image_tag": "latest"},
                                        allow_lists=False)
    with pytest.raises(BackendConfigError, match=r"name a release such as v0\.32\.0"):
        check_allowed(stored.as_dict())


def test_a_pod_monitor_is_rendered_when_asked(deployment: Any) -> None:
    assert "PodMonitor" not in [o["kind"] for o in render(
        deployment, KubernetesConfig.from_dict({"namespace": "a"}))]
    monitor = of_kind(render(deployment, KubernetesConfig.from_dict(
        {"namespace": "a", "pod_monitor": True})), "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"] == "chat"
    assert monitor["metadata"]["labels"] == owner_labels(deployment)
    assert monitor["spec"] == {
        "selector": {"matchLabels": owner_labels(deployment)},
        "podMetricsEndpoints": [{"port": "http", "path": "/metrics"}],
        "podTargetLabels": ["app.kubernetes.io/instance", "fleetplane.io/install"]}


def test_topology_spread_and_a_priority_class_are_offered(deployment: Any,
                                                          settings: Any) -> None:
    plain = pod_of(render(deployment, KubernetesConfig.from_dict({"namespace": "a"})))
    assert "topologySpreadConstraints" not in plain and "priorityClassName" not in plain
    settings.KUBERNETES_ALLOWED_PRIORITY_CLASSES = ["inference-high"]
    objects = render(deployment, KubernetesConfig.from_dict({
        "namespace": "a", "priority_class_name": "inference-high",
        "topology_spread": ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]}))
    validate(objects)
    pod = pod_of(objects)
    assert pod["priorityClassName"] == "inference-high"
    zone, host = pod["topologySpreadConstraints"]
    assert zone["topologyKey"] == "topology.kubernetes.io/zone"
    assert host["whenUnsatisfiable"] == "ScheduleAnyway" and host["maxSkew"] == 1
    assert host["labelSelector"] == {"matchLabels": owner_labels(deployment)}
    strict = pod_of(render(deployment, KubernetesConfig.from_dict({
        "namespace": "a", "topology_spread": ["kubernetes.io/hostname"],
        "topology_spread_when_unsatisfiable": "DoNotSchedule"})))
    assert strict["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "DoNotSchedule"


def test_the_rollout_surge_is_configurable_and_the_budget_follows(deployment: Any) -> None:
    default = render(deployment, KubernetesConfig.from_dict({"namespace": "a"}))
    assert of_kind(default, "Deployment")["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 1, "maxUnavailable": 0}
    assert of_kind(default, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    full_pool = render(deployment, KubernetesConfig.from_dict(
        {"namespace": "a", "max_surge": 0, "max_unavailable": 2}))
    validate(full_pool)
    assert of_kind(full_pool, "Deployment")["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0, "maxUnavailable": 2}
    assert of_kind(full_pool, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 2
    shares = render(deployment, KubernetesConfig.from_dict(
        {"namespace": "a", "max_surge": "25%", "max_unavailable": "25%"}))
    validate(shares)
    assert of_kind(shares, "PodDisruptionBudget")["spec"]["maxUnavailable"] == "25%"


# --- native scaling ------------------------------------------------------------------------

def test_hpa_and_keda_scale_on_running_and_waiting_with_one_target(deployment: Any) -> None:
    config = KubernetesConfig.from_dict({"namespace": "inference"})
    hpa = of_kind(render(deployment, config, "hpa"), "HorizontalPodAutoscaler")
    [metric] = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "vllm_requests_running_and_waiting"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "16"}
    keda = of_kind(render(deployment, config, "keda"), "ScaledObject")
    [trigger] = keda["spec"]["triggers"]
    assert "vllm:num_requests_running{" in trigger["metadata"]["query"]
    assert "vllm:num_requests_waiting{" in trigger["metadata"]["query"]
    # Only this deployment's pods of this install, not every server of the model name.
    assert (f'app_kubernetes_io_instance="{object_name(deployment.name)}",'
            f'fleetplane_io_install="fleetplane"') in trigger["metadata"]["query"]
    assert trigger["metadata"]["threshold"] == "16"
    deployment.autoscaling = {"enabled": True, "signals": [
        {"name": "waiting_per_replica", "target": 2},
        {"name": "queue_per_replica", "target": 24}]}
    hpa = of_kind(render(deployment, config, "hpa"), "HorizontalPodAutoscaler")
    keda = of_kind(render(deployment, config, "keda"), "ScaledObject")
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "24"
    assert keda["spec"]["triggers"][0]["metadata"]["threshold"] == "24"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        keda["spec"]["minReplicaCount"], keda["spec"]["maxReplicaCount"]) == (1, 6)


def test_keda_goes_to_zero_only_when_a_held_request_can_wake_it(deployment: Any) -> None:
    deployment.min_replicas = 0
    deployment.autoscaling = {"enabled": True}
    unscraped = of_kind(render(deployment, KubernetesConfig.from_dict(
        {"namespace": "inference"}), "keda"), "ScaledObject")
    assert unscraped["spec"]["minReplicaCount"] == 1  # nothing could wake it
    assert len(unscraped["spec"]["triggers"]) == 1
    hpa = of_kind(render(deployment, KubernetesConfig.from_dict(
        {"namespace": "inference", "gateway_scraped": True}), "hpa"),
        "HorizontalPodAutoscaler")
    assert hpa["spec"]["minReplicas"] == 1  # an HPA never goes to zero
    woken = of_kind(render(deployment, KubernetesConfig.from_dict(
        {"namespace": "inference", "gateway_scraped": True}), "keda"), "ScaledObject")
    assert woken["spec"]["minReplicaCount"] == 0
    _, wake = woken["spec"]["triggers"]
    assert wake["type"] == "prometheus"
    assert wake["metadata"]["query"] == (
        'sum(fleetplane_gateway_cold_start_waiting_requests{namespace="fleetplane",'
        'deployment="chat"}) or vector(0)')
    assert wake["metadata"]["activationThreshold"] == "0"
    # Without an enabled policy the gateway holds no request for it: no wake path.
    deployment.autoscaling = None
    held_nowhere = of_kind(render(deployment, KubernetesConfig.from_dict(
        {"namespace": "inference", "gateway_scraped": True}), "keda"), "ScaledObject")
    assert held_nowhere["spec"]["minReplicaCount"] == 1


@pytest.mark.parametrize(("raw", "field"), [
    ({"namespace": "a", "image_tag": "latest"}, "image_tag"),
    ({"namespace": "a", "image_tag": "v1 ; rm"}, "image_tag"),
    ({"namespace": "a", "cpu_per_gpu": "0"}, "cpu_per_gpu"),
    ({"namespace": "a", "memory_per_gpu": "lots"}, "memory_per_gpu"),
    ({"namespace": "a", "gpus_per_node": 0}, "gpus_per_node"),
    ({"namespace": "a", "download_cache_size": "big"}, "download_cache_size"),
    ({"namespace": "a", "download_cache_pvc": "Bad_Name"}, "download_cache_pvc"),
    ({"namespace": "a", "max_surge": -1}, "max_surge"),
    ({"namespace": "a", "max_unavailable": "150%"}, "max_unavailable"),
    ({"namespace": "a", "max_surge": 0, "max_unavailable": "0%"}, "max_unavailable"),
    ({"namespace": "a", "topology_spread": "kubernetes.io/hostname"}, "topology_spread"),
    ({"namespace": "a", "topology_spread": ["not a key"]}, "topology_spread"),
    ({"namespace": "a", "topology_spread_when_unsatisfiable": "Maybe"},
     "topology_spread_when_unsatisfiable"),
    ({"namespace": "a", "priority_class_name": "system-node-critical"},
     "priority_class_name"),
    ({"namespace": "a", "extra_labels": {"team": "a b"}}, "extra_labels"),
    ({"namespace": "a", "gateway_scraped": "yes"}, "gateway_scraped"),
    ({"namespace": "a", "pod_monitor": 1}, "pod_monitor"),
])
def test_bad_new_settings_name_themselves(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(BackendConfigError) as caught:
        KubernetesConfig.from_dict(raw)
    assert caught.value.field == field


@pytest.mark.parametrize(("raw", "field", "says"), [
    # A priority class, a claim mounted read-write and a Prometheus for KEDA's operator to
    # query: each only where the install's settings list it.
    ({"priority_class_name": "inference-high"}, "priority_class_name",
     "KUBERNETES_ALLOWED_PRIORITY_CLASSES"),
    ({"download_cache_pvc": "models"}, "download_cache_pvc",
     "KUBERNETES_ALLOWED_CACHE_CLAIMS"),
    ({"prometheus_address": "http://169.254.169.254/latest"}, "prometheus_address",
     "KUBERNETES_ALLOWED_PROMETHEUS_ADDRESSES"),
    # A toleration without a key tolerates every taint of every node.
    ({"tolerations": [{"operator": "Exists"}]}, "tolerations", "names the taint's `key`"),
    ({"tolerations": [{"key": "gpu", "operator": "Maybe"}]}, "tolerations", "`operator`"),
    ({"tolerations": [{"key": "gpu", "effect": "Everything"}]}, "tolerations", "`effect`"),
    ({"tolerations": [{"key": "gpu", "nodeName": "x"}]}, "tolerations", "unknown"),
])
def test_what_an_admin_key_may_not_configure_past_the_installs_lists(
        raw: dict[str, Any], field: str, says: str) -> None:
    with pytest.raises(BackendConfigError) as caught:
        KubernetesConfig.from_dict({"namespace": "a", **raw})
    assert caught.value.field == field and says in caught.value.message


@pytest.mark.parametrize("value", ["Staging", "1st", "a" * 21, "has_underscore", "end-"])
def test_an_install_id_that_cannot_label_or_prefix_stops_start_up(
        tmp_path: Any, value: str) -> None:
    from tests.controlplane.test_settings import manage

    result = manage("check", tmp_path=tmp_path, DEBUG="true", INSTALL_ID=value)
    assert result.returncode == 2
    assert f"INSTALL_ID={value!r}: use 1 to 20 lower-case letters" in result.stderr
    assert manage("check", tmp_path=tmp_path, DEBUG="true",
                  INSTALL_ID="staging-2").returncode == 0
