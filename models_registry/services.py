"""State changes of the registry: register, import, delete.

Bad input is refused (ModelSourceError) before any record or folder exists. A GGUF import
that fails midway leaves the model `failed` with the reason and removes its half-written
folder.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import close_old_connections, connection, transaction

from access import signals
from models_registry import importers
from models_registry.importers import ModelSourceError
from models_registry.models import Model

logger = logging.getLogger(__name__)

IMPORTING_PREFIX = ".importing-"


class ModelConflictError(Exception):
    """The request conflicts with the model's current state."""


@dataclass
class ModelSpec:
    name: str
    source: str
    uri: str
    display_name: str = ""
    revision: str = ""
    license: str = ""


class ModelNameTaken(ModelSourceError):
    """Another model has that name (a conflict, not bad input)."""


def models_dir() -> Path:
    path = Path(settings.MODELS_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


# Names end up in process names, URLs and Kubernetes object names: a DNS-1123 label.
NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def validate_name(name: str) -> None:
    if not NAME_PATTERN.match(name or ""):
        raise ModelSourceError(
            "name", f"{name!r} is not a slug: use 1 to 63 lower-case letters, digits and "
            f"hyphens, starting and ending with a letter or digit"
        )
    if Model.objects.filter(name=name).exists():
        raise ModelNameTaken("name", f"a model named {name!r} already exists")


def import_roots() -> list[Path]:
    """Where local paths may be registered from: MODEL_IMPORT_ROOTS, or by default the
    registry's own folders (read at call time, so a changed MODELS_DIR counts)."""
    configured = getattr(settings, "MODEL_IMPORT_ROOTS", None)
    if configured:
        return [Path(root) for root in configured]
    return [Path(settings.MODELS_DIR), Path(settings.DATA_DIR) / "models"]


def register_model(spec: ModelSpec, *, import_in_background: bool = True,
                   actor: str = "system", trusted_path: bool = False) -> Model:
    """Register a model. Local folders are ready at once; GGUF files are converted (in a
    background thread unless told otherwise); Hugging Face ids are recorded. The audit
    log records who registered it.

    A local path must lie under the import roots (import_roots()); `trusted_path` is for
    paths the program chose itself (the demo model inside its installed package), never
    for a path a person typed."""
    if spec.source in (Model.Source.LOCAL, Model.Source.GGUF) and not trusted_path:
        validate_name(spec.name)
        spec = dataclasses.replace(
            spec, uri=str(importers.check_import_path(spec.uri, import_roots())))
    model = _register(spec, import_in_background)
    signals.record(actor, "model-registered", f"model {model.name} registered ({model.source})",
                   after=model_summary(model))
    return model


def model_summary(model: Model) -> dict[str, Any]:
    return {"name": model.name, "source": model.source, "source_uri": model.source_uri,
            "path": model.path, "status": model.status, "revision": model.revision}


def _register(spec: ModelSpec, import_in_background: bool) -> Model:
    validate_name(spec.name)
    if spec.source == Model.Source.LOCAL:
        folder = Path(spec.uri).expanduser()
        facts = importers.inspect_hf_folder(folder)
        model = Model.objects.create(
            name=spec.name, display_name=spec.display_name or spec.name, source=spec.source,
            source_uri=str(folder.resolve()), path=str(folder.resolve()),
            revision=spec.revision, license=spec.license, status=Model.Status.READY,
            progress=100.0, error="; ".join(facts.notes), **facts.as_model_fields(),
        )
        return model
    if spec.source == Model.Source.PACKAGE:
        return _register_package(spec)
    if spec.source == Model.Source.GGUF:
        file = Path(spec.uri).expanduser()
        metadata = importers.inspect_gguf(file)
        with transaction.atomic():
            model = Model.objects.create(
                name=spec.name,
                display_name=spec.display_name or str(metadata.get("general.name") or spec.name),
                source=spec.source, source_uri=str(file.resolve()), revision=spec.revision,
                license=spec.license or str(metadata.get("general.license") or ""),
                architecture=str(metadata.get("general.architecture", "")),
                status=Model.Status.IMPORTING, progress=0.0,
            )
            if import_in_background:
                model_id = model.pk
                transaction.on_commit(lambda: start_import_thread(model_id))
        if not import_in_background:
            import_gguf_model(model.pk, show_progress=True)
            model.refresh_from_db()
        return model
    if spec.source == Model.Source.HUGGINGFACE:
        note = ""
        try:
            facts = importers.inspect_hf_id(
                spec.uri, spec.revision, hub_access=settings.HUB_ACCESS,
                endpoint=settings.HF_ENDPOINT, timeout=settings.HUB_TIMEOUT_SECONDS,
            )
            note = "; ".join(facts.notes)
        except importers.HubUnreachableError as exc:
            facts, note = importers.ModelFacts(), str(exc)
        return Model.objects.create(
            name=spec.name, display_name=spec.display_name or spec.uri, source=spec.source,
            source_uri=spec.uri, revision=spec.revision, license=spec.license,
            status=Model.Status.REGISTERED, error=note, **facts.as_model_fields(),
        )
    raise ModelSourceError("source", f"unknown source {spec.source!r}")


def _register_package(spec: ModelSpec) -> Model:
    """A model folder inside an installed Python package, served where pip put it; its
    revision is the package's version unless one is given."""
    from importlib import metadata

    folder = importers.package_model_folder(spec.uri)
    facts = importers.inspect_hf_folder(folder, field="package")
    return Model.objects.create(
        name=spec.name, display_name=spec.display_name or spec.name, source=spec.source,
        source_uri=spec.uri, path=str(folder),
        revision=spec.revision or metadata.version(spec.uri), license=spec.license,
        status=Model.Status.READY, progress=100.0, error="; ".join(facts.notes),
        **facts.as_model_fields())


def start_import_thread(model_id: int) -> threading.Thread:
    thread = threading.Thread(target=_import_in_thread, args=(model_id,),
                              name=f"import-model-{model_id}", daemon=True)
    thread.start()
    return thread


class _ProgressRecorder:
    """Writes the import's progress to the model row (throttled) and, on a terminal, to a
    tqdm bar."""

    def __init__(self, model_id: int, show: bool) -> None:
        self.model_id = model_id
        self.last_write = 0.0
        self.bar = None
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=100, unit="%", desc="importing", bar_format=(
                "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}] {postfix}"))

    def __call__(self, percent: float, stage: str) -> None:
        if self.bar is not None:
            self.bar.n = percent
            self.bar.set_postfix_str(stage)
            self.bar.refresh()
        now = time.monotonic()
        if now - self.last_write >= 0.5 or percent >= 100:
            Model.objects.filter(pk=self.model_id).update(progress=percent)
            self.last_write = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _import_in_thread(model_id: int) -> None:
    close_old_connections()
    try:
        import_gguf_model(model_id)
    finally:
        connection.close()


def import_gguf_model(model_id: int, *, show_progress: bool = False) -> None:
    """Convert a registered GGUF model into its folder; mark it ready or failed."""
    work_dir: Path | None = None
    recorder = _ProgressRecorder(model_id, show_progress)
    try:
        model = Model.objects.get(pk=model_id)
        target = models_dir() / model.name
        work_dir = Path(tempfile.mkdtemp(prefix=f"{IMPORTING_PREFIX}{model.name}-",
                                         dir=models_dir()))
        importers.convert_gguf(Path(model.source_uri), work_dir, recorder)
        facts = importers.inspect_hf_folder(work_dir)
        if target.exists():
            shutil.rmtree(target)
        work_dir.rename(target)
        work_dir = None
        facts.size_bytes = importers.folder_size(target)
        Model.objects.filter(pk=model_id).update(
            status=Model.Status.READY, progress=100.0, path=str(target), error="",
            **{k: v for k, v in facts.as_model_fields().items() if k != "architecture"},
            architecture=facts.architecture,
        )
        logger.info("model %s imported into %s", model.name, target)
    except Exception as exc:
        logger.exception("import of model %s failed", model_id)
        Model.objects.filter(pk=model_id).update(
            status=Model.Status.FAILED, error=f"import failed: {exc.__class__.__name__}: {exc}"
        )
    finally:
        recorder.close()
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)


def recover_interrupted_imports() -> int:
    """After a restart no import thread survives: mark imports that were running as failed
    and remove their half-written folders. Returns how many models were marked."""
    marked = Model.objects.filter(status=Model.Status.IMPORTING).update(
        status=Model.Status.FAILED, error="import interrupted by a restart; register it again"
    )
    root = Path(settings.MODELS_DIR)
    if root.is_dir():
        for leftover in root.glob(f"{IMPORTING_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)
    return marked


def delete_model(model: Model, *, actor: str = "system") -> None:
    if model.status == Model.Status.IMPORTING:
        raise ModelConflictError(f"model {model.name} is importing; wait for it to finish")
    before = model_summary(model)
    managed_root = Path(settings.MODELS_DIR).resolve()
    folder = Path(model.path).resolve() if model.path else None
    with transaction.atomic():
        model.delete()
        signals.record(actor, "model-deleted", f"model {before['name']} deleted", before=before)
        # Only folders the registry wrote itself are removed; a registered local folder
        # belongs to its owner.
        if folder is not None and folder.parent == managed_root and model.source == "gguf":
            transaction.on_commit(lambda: shutil.rmtree(folder, ignore_errors=True))
