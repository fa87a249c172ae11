"""Hugging Face Hub ids (``org/name``) -> a local snapshot folder, resolved as vLLM resolves them.

The local Hugging Face cache comes first (``HF_HOME`` / ``HF_HUB_CACHE``; no network, so offline runs work once the
files are cached); only a model the cache lacks is downloaded (huggingface_hub, a progress bar on a terminal), and
only the files pagedllm reads. With ``HF_HUB_OFFLINE=1`` a model that is not cached fails in one line naming the id,
the cache and the variable.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
from typing import Iterator, Optional

from pagedllm.errors import ModelNotFoundError, UnsupportedModelError
from pagedllm.startup_log import show_bars, stage

#: What a safetensors checkpoint needs: configs, weights, tokenizer files, chat templates (never code).
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
#: Meta's original-format copies and Mistral's consolidated file duplicate the HF shards.
SKIPPED_PATTERNS = ["original/*", "consolidated*.safetensors"]


def is_hub_id(model: str) -> bool:
    """``org/name`` as the Hub spells repositories (a path that is not there and has exactly one ``/``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def usable_snapshot(folder: str) -> bool:
    """A snapshot holding what :func:`~pagedllm.models.paths.resolve_model_path` loads: config + safetensors, or a
    ``.gguf`` file."""
    if glob.glob(os.path.join(folder, "*.gguf")):
        return True
    return os.path.isfile(os.path.join(folder, "config.json")) and bool(
        glob.glob(os.path.join(folder, "*.safetensors")))


def cached_snapshot(repo_id: str, revision: Optional[str] = None) -> Optional[str]:
    """The cache's snapshot folder of ``repo_id`` at ``revision`` (default: ``refs/main``), or None; no network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, OSError):
        return None
    return folder if usable_snapshot(folder) else None


@contextlib.contextmanager
def hub_progress_bars() -> Iterator[None]:
    """huggingface_hub's download bars on a terminal only (a log gets the stage line, not a bar per file)."""
    from huggingface_hub.utils import (are_progress_bars_disabled, disable_progress_bars,
                                       enable_progress_bars)

    was_disabled = are_progress_bars_disabled()
    if not show_bars():
        disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def download_patterns(repo_id: str, files: list[str]) -> tuple[list[str], list[str]]:
    """(allow, ignore) patterns for ``snapshot_download``: the safetensors checkpoint, or the repository's one
    ``.gguf`` file."""
    if any(f.endswith(".safetensors") for f in files):
        return CHECKPOINT_PATTERNS, SKIPPED_PATTERNS
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return ggufs, []
    if ggufs:
        shown = ", ".join(ggufs[:6]) + (", ..." if len(ggufs) > 6 else "")
        raise UnsupportedModelError(f"model: {repo_id} holds {len(ggufs)} .gguf files ({shown}); download one with "
                                    f"`hf download {repo_id} FILE` and pass its path as the model")
    raise UnsupportedModelError(f"model: {repo_id} on the Hugging Face Hub holds no *.safetensors or .gguf weights "
                                "(other formats are not loaded)")


@functools.lru_cache(maxsize=None)
def snapshot_path(repo_id: str, revision: Optional[str] = None) -> str:
    """The local folder of Hub model ``repo_id``: its cached snapshot, else a fresh download (once per process)."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    cache = constants.HF_HUB_CACHE
    folder = cached_snapshot(repo_id, revision)
    if folder is not None:
        stage("model %s: in the Hugging Face cache, %s", repo_id, folder)
        return folder
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"model: {repo_id} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 "
                                 "forbids downloading it; unset HF_HUB_OFFLINE to download it, or pass a local "
                                 "folder or .gguf file")
    stage("model %s: not in the Hugging Face cache, downloading it from the Hub into %s", repo_id, cache)
    try:
        info = HfApi().model_info(repo_id, revision=revision)
        allow, ignore = download_patterns(repo_id, [s.rfilename for s in info.siblings or []])
        with hub_progress_bars():
            folder = snapshot_download(repo_id, revision=revision, allow_patterns=allow, ignore_patterns=ignore)
    except GatedRepoError:
        raise ModelNotFoundError(f"model: {repo_id} is gated on the Hugging Face Hub; accept its terms at "
                                 f"https://huggingface.co/{repo_id}, then log in (`hf auth login` or HF_TOKEN)"
                                 ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"model: {repo_id} has no revision {revision!r} on the Hugging Face Hub") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"model: {repo_id} is neither a local path nor a model on the Hugging Face Hub (a "
                                 "private one needs `hf auth login` or HF_TOKEN)") from None
    except UnsupportedModelError:
        raise
    except Exception as e:  # noqa: BLE001 - network and HTTP failures of every client layer: one line
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFoundError(f"model: cannot download {repo_id} from the Hugging Face Hub ({reason}); check the "
                                 f"network, or set HF_HUB_OFFLINE=1 to use the cache ({cache}) only") from None
    stage("model %s: downloaded to %s", repo_id, folder)
    return folder
