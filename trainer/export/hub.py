"""`--push`: the exported folder to a Hugging Face hub repository in one commit (huggingface_hub's upload_folder), so
a refused or broken upload leaves nothing on the hub that looks like the model. The token comes from where
huggingface_hub looks (HF_TOKEN, `hf auth login`); the hub is HF_ENDPOINT's."""

from __future__ import annotations

from pathlib import Path

from trainer.export.origin import ExportError


def push(folder: Path, repo_id: str, private: bool, message: str) -> str:
    """Create `repo_id` if needed (private unless asked otherwise), upload `folder` as one commit; the commit's URL."""
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError

    token = get_token()
    if not token:
        raise ExportError(
            f"no Hugging Face token to push to {repo_id}: run `hf auth login` or set HF_TOKEN, then push the exported "
            f"folder with the same command (the export in {folder} is complete)"
        )
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=message)
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise ExportError(
            f"the hub refused the upload to {repo_id} (HTTP {status}: {str(exc).splitlines()[0]}); nothing was "
            f"committed. Check the token's write access to that namespace; the export in {folder} is complete"
        ) from exc
    except transport_errors() as exc:
        raise ExportError(
            f"the hub at {constants.ENDPOINT} could not be reached ({type(exc).__name__}: {exc}); nothing was "
            f"committed to {repo_id}. Push again when it answers; the export in {folder} is complete"
        ) from exc
    return str(info.commit_url)


def transport_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the hub cannot be reached: its HTTP library's errors (httpx before 2.0,
    httpx2 from 2.0 on) and the OS's."""
    import importlib

    found: list[type[BaseException]] = [OSError]
    for module in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(module).HTTPError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)
