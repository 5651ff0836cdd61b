"""Where models come from: the bundled tiny models, local folders, or the hub when online."""

from __future__ import annotations

from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parents[1] / "bundled"


def list_models() -> list[str]:
    """Names of the models that ship inside the package."""
    if not BUNDLED_DIR.is_dir():
        return []
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "config.json").is_file())


def model_path(name: str) -> Path:
    """The Hugging Face folder of a bundled model, e.g. `model_path("tiny")`."""
    if not isinstance(name, str) or name not in list_models():
        raise ValueError(f"unknown bundled model {name!r}; bundled models: {', '.join(list_models())}")
    return BUNDLED_DIR / name


def resolve_model(model: str | Path) -> Path:
    """A bundled name, a local Hugging Face folder, or (online) a hub id -> local folder."""
    if not isinstance(model, (str, Path)) or str(model) == "":
        raise ValueError(f"model must be a bundled name ({', '.join(list_models())}), a local "
                         f"Hugging Face folder or a hub id; got {model!r}")
    if isinstance(model, str) and model in list_models():
        return model_path(model)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model {str(model)!r} is a file; pass the Hugging Face folder that holds "
                         "config.json and model.safetensors")
    text = str(model)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return _download(text)
    raise ValueError(f"unknown model {text!r}: not a bundled model ({', '.join(list_models())}) "
                     "and not an existing folder")


def _download(repo_id: str) -> Path:
    """Hub ids are an option for online users; nothing in tests or lessons needs the network."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.jinja"]))
    except Exception as e:  # offline, unknown repo, gated model...
        raise ValueError(f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: "
                         f"{e}); offline, use a bundled model ({', '.join(list_models())}) or a "
                         "local folder") from None
