"""Training runs and checkpoints over REST (trainer/service/checkpoints.py): the unmodified SDK's RestClient against
the service app in this process (tiny model, CPU, no gateway): runs with their user_metadata, listings and their
cursors, deletes (folders gone from disk), TTL expiry by the reaper, a restart, not-found errors, refusals by name,
and tinker paths that try to leave the service's folder."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import make_cfg, serve_app
from trainer.service.checkpoints import Catalog, NotFound
from trainer.service.wire import UserError

tinker = pytest.importorskip("tinker")

KEY = "tml-local-test"


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> Any:
    from trainer.service.policies import MultiLora

    return MultiLora(make_cfg(tmp_path_factory.mktemp("model")))


@contextmanager
def serve(out: Path, policies: Any, service: list[Any] | None = None) -> Iterator[str]:
    """A service writing under `out` (its Service appended to `service` when given)."""
    from trainer.service.routes import build_app

    cfg = make_cfg(out.parent / "cfg", service__output_dir=str(out), service__max_clients=64)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    app = build_app(cfg, policies)
    if service is not None:
        service.append(app.state.service)
    with serve_app(app, sock) as url:
        yield url


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("service") / "out"


SERVICE: list[Any] = []  # the module's Service, for the stand-in gateway


@pytest.fixture(scope="module")
def url(out, policies) -> Iterator[str]:
    with serve(out, policies, SERVICE) as base:
        yield base


@pytest.fixture(scope="module")
def service_client(url) -> Any:
    return tinker.ServiceClient(base_url=url, api_key=KEY)


@pytest.fixture(scope="module")
def rest(url) -> Any:
    return tinker.RestClient(base_url=url, api_key=KEY)


def training_client(sc: Any, **metadata: str) -> Any:
    return sc.create_lora_training_client(base_model="tiny", rank=4, user_metadata=metadata or None).result()


def run_folder(out: Path, run_id: str) -> Path:
    from trainer.service.app import safe_name

    return out / safe_name(run_id)


def listed(rest: Any, run_id: str) -> dict[str, Any]:
    return {c.checkpoint_id: c for c in rest.list_checkpoints(run_id).result().checkpoints}


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.1)


def test_a_run_and_its_user_metadata_by_id_and_by_tinker_path(service_client, rest):
    tc = training_client(service_client, renderer_name="llama3", wandb_link="none")
    path = tc.save_state("first", user_metadata={"step": "1"}).result().path
    # the cookbook's renderer check goes through the ServiceClient's own RestClient
    run = service_client.create_rest_client().get_training_run_by_tinker_path(path).result()
    assert run.training_run_id == tc.model_id
    assert run.user_metadata == {"renderer_name": "llama3", "wandb_link": "none"}
    assert (run.base_model, run.is_lora, run.lora_rank) == ("tiny", True, 4)
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == path
    assert run.last_sampler_checkpoint is None
    assert rest.get_training_run(tc.model_id).result() == run
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_attn) == ("tiny", True, 4, True)
    assert listed(rest, tc.model_id)["weights/first"].user_metadata == {"step": "1"}


def test_listings_page_with_the_sdks_cursor(service_client, rest):
    runs = [training_client(service_client, n=str(i)).model_id for i in range(3)]
    everything = rest.list_training_runs(limit=100).result()
    assert set(runs) <= {r.training_run_id for r in everything.training_runs}
    page = rest.list_training_runs(limit=2, offset=1).result()
    assert (page.cursor.offset, page.cursor.limit) == (1, 2)
    assert page.cursor.total_count == everything.cursor.total_count == len(everything.training_runs)
    assert page.training_runs == everything.training_runs[1:3]
    # create_training_client_from_state keeps the user_metadata it is given
    seed = training_client(service_client).save_state("seed").result().path
    tc = service_client.create_training_client_from_state(seed, user_metadata={"from": "state"}).result()
    assert rest.get_training_run(tc.model_id).result().user_metadata == {"from": "state"}
    checkpoints = rest.list_user_checkpoints(limit=1000).result()
    newest = rest.list_user_checkpoints(limit=1).result()
    assert newest.cursor is not None and newest.cursor.total_count == len(checkpoints.checkpoints) >= 1
    assert newest.checkpoints == checkpoints.checkpoints[:1]
    times = [c.time for c in checkpoints.checkpoints]
    assert times == sorted(times, reverse=True)


def test_delete_by_tinker_path_and_by_id_removes_the_folders(service_client, rest, out):
    tc = training_client(service_client)
    state = tc.save_state("rolling-1").result().path
    tc.save_weights_for_sampler("for-sampling").result()
    found = listed(rest, tc.model_id)
    assert {k: c.checkpoint_type for k, c in found.items()} == {
        "weights/rolling-1": "training",
        "sampler_weights/for-sampling": "sampler",
    }
    assert all(c.size_bytes and c.public is False and c.expires_at is None for c in found.values())
    folder = run_folder(out, tc.model_id)
    assert (folder / "weights" / "rolling-1").is_dir() and (
        folder / "sampler_weights" / "for-sampling"
    ).is_dir()
    rest.delete_checkpoint_from_tinker_path(state).result()
    rest.delete_checkpoint(tc.model_id, "sampler_weights/for-sampling").result()
    assert listed(rest, tc.model_id) == {}
    assert not (folder / "weights" / "rolling-1").exists()
    assert not (folder / "sampler_weights" / "for-sampling").exists()
    with pytest.raises(tinker.NotFoundError, match="rolling-1"):
        rest.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.RequestFailedError, match="no saved state"):
        service_client.create_training_client_from_state(state).result()


def test_a_delete_cut_short_leaves_no_half_checkpoint_that_lists_or_loads(
    service_client, rest, out, monkeypatch
):
    """The folder leaves the listing in one rename before its files go: a delete killed half way used to leave a
    checkpoint that still listed and then failed load_state with a server error."""
    import shutil

    from trainer.service import checkpoints

    tc = training_client(service_client)
    state = tc.save_state("cut-short").result().path
    real = shutil.rmtree

    def killed_half_way(path: Any, *args: Any, **kwargs: Any) -> None:
        first = next(p for p in Path(path).iterdir() if p.is_file())
        first.unlink()  # some files gone, then the process "dies"
        raise OSError("killed")

    monkeypatch.setattr(checkpoints.shutil, "rmtree", killed_half_way)
    with contextlib.suppress(Exception):
        rest.delete_checkpoint_from_tinker_path(state).result()
    monkeypatch.setattr(checkpoints.shutil, "rmtree", real)
    assert "weights/cut-short" not in listed(rest, tc.model_id)
    with pytest.raises(tinker.RequestFailedError, match="no saved state") as failed:
        service_client.create_training_client_from_state(state).result()
    assert failed.value.category == tinker.types.RequestErrorCategory.User


def test_a_client_whose_state_fails_to_load_holds_no_slot(service_client, out):
    tc = training_client(service_client)
    state = tc.save_state("to-break").result().path
    folder = run_folder(out, tc.model_id) / "weights" / "to-break"
    (folder / "adapter.safetensors").write_bytes(b"not safetensors")
    before = len(SERVICE[0].models)
    for _ in range(3):
        with pytest.raises(tinker.RequestFailedError):
            service_client.create_training_client_from_state(state).result()
    assert len(SERVICE[0].models) == before  # each failed load gave its client's place back


def test_a_client_under_a_session_never_opened_is_refused(url):
    """Client-chosen session ids made clients no reaper would free (7 of them filled max_clients until a restart)."""
    import httpx

    headers = {"X-API-Key": KEY}
    body = {
        "session_id": "sess-never-opened",
        "model_seq_id": 0,
        "base_model": "tiny",
        "lora_config": {"rank": 4},
    }
    future = httpx.post(f"{url}/api/v1/create_model", json=body, headers=headers).json()
    answer = httpx.post(f"{url}/api/v1/retrieve_future", json=future, headers=headers, timeout=60).json()
    assert "no open session 'sess-never-opened'" in str(answer), answer
    assert "model_id" not in answer


@dataclass
class StandInGateway:
    """What the service asks of its gateway when sampler weights go: is the adapter being sampled, and unload it."""

    in_flight: dict[str, int] = field(default_factory=dict)
    unloaded: list[str] = field(default_factory=list)

    async def forget(self, name: str) -> None:
        self.unloaded.append(name)


def test_deleting_sampler_weights_drops_their_sampling_sessions_and_adapter(service_client, rest, url):
    service, gateway = SERVICE[0], StandInGateway()
    service.sampler = gateway
    try:
        tc = training_client(service_client)
        path = tc.save_weights_for_sampler("served").result().path
        service_client.create_sampling_client(model_path=path).result()
        (sampler_id, sampler), *others = [(i, s) for i, s in service.samplers.items() if s.model_path == path]
        assert not others and sampler.adapter is not None
        gateway.in_flight[sampler.adapter] = 1
        with pytest.raises(tinker.BadRequestError, match="being sampled"):
            rest.delete_checkpoint_from_tinker_path(path).result()
        assert sampler_id in service.samplers and "sampler_weights/served" in listed(rest, tc.model_id)
        gateway.in_flight.clear()
        rest.delete_checkpoint_from_tinker_path(path).result()
        assert gateway.unloaded == [sampler.adapter]
        assert sampler_id not in service.samplers and sampler.folder not in service.adapter_of
        assert not sampler.folder.exists()
    finally:
        service.sampler = None


@pytest.fixture
def quick_reaper(monkeypatch) -> None:
    """The reaper's round every 0.1 s instead of every second: expiries land within 0.1 s of their time."""
    from trainer.service import checkpoints

    monkeypatch.setattr(checkpoints, "REAP_EVERY_S", 0.1)


def test_ttl_expiry_deletes_the_checkpoint_and_set_ttl_changes_it(service_client, rest, out, quick_reaper):
    tc = training_client(service_client)
    brief = tc.save_state("brief", ttl_seconds=1).result().path
    kept = tc.save_weights_for_sampler("kept", ttl_seconds=3600).result().path
    entry = listed(rest, tc.model_id)["weights/brief"]
    assert entry.expires_at is not None and 0.5 <= (entry.expires_at - entry.time).total_seconds() <= 1.5
    folder = run_folder(out, tc.model_id) / "weights" / "brief"
    assert folder.is_dir()
    wait_until(lambda: "weights/brief" not in listed(rest, tc.model_id))
    assert not folder.exists()
    assert listed(rest, tc.model_id)["sampler_weights/kept"].expires_at is not None
    rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()
    assert listed(rest, tc.model_id)["sampler_weights/kept"].expires_at is None
    rest.set_checkpoint_ttl_from_tinker_path(kept, 1).result()
    wait_until(lambda: listed(rest, tc.model_id) == {})
    with pytest.raises(tinker.NotFoundError):
        rest.set_checkpoint_ttl_from_tinker_path(brief, 60).result()


def test_unknown_ids_are_the_sdks_not_found(service_client, rest):
    run_id = training_client(service_client).model_id
    for call in (
        lambda: rest.get_training_run("sess-x:train:0"),
        lambda: rest.get_training_run_by_tinker_path("tinker://nope/weights/a"),
        lambda: rest.list_checkpoints("nope"),
        lambda: rest.delete_checkpoint(run_id, "weights/never-saved"),
        lambda: rest.delete_checkpoint_from_tinker_path(f"tinker://{run_id}/sampler_weights/never-saved"),
        lambda: rest.get_weights_info_by_tinker_path(f"tinker://{run_id}/weights/never-saved"),
    ):
        with pytest.raises(tinker.NotFoundError):
            call().result()


def test_bad_input_is_a_user_error_naming_the_field(service_client, rest):
    tc = training_client(service_client)
    with pytest.raises(tinker.RequestFailedError, match=r"save_state\.ttl_seconds") as failed:
        tc.save_state("never", ttl_seconds=0).result()
    assert failed.value.category == tinker.types.RequestErrorCategory.User
    with pytest.raises(tinker.RequestFailedError, match=r"save_weights_for_sampler\.ttl_seconds"):
        tc.save_weights_for_sampler("never", ttl_seconds=-5).result()
    with pytest.raises(tinker.RequestFailedError, match=r"create_model\.user_metadata values"):
        service_client.create_lora_training_client(base_model="tiny", rank=4, user_metadata={"n": 1}).result()
    with pytest.raises(tinker.RequestFailedError, match=r"create_model\.user_metadata has 1 entries"):
        big = {"blob": "x" * 20000}  # every listing carries it: labels, not data
        service_client.create_lora_training_client(base_model="tiny", rank=4, user_metadata=big).result()
    assert listed(rest, tc.model_id) == {}  # nothing saved by the refused calls
    with pytest.raises(tinker.BadRequestError, match="'limit'"):
        rest.list_training_runs(limit=-1).result()
    with pytest.raises(tinker.BadRequestError, match="access_scope"):
        rest.get_training_run(tc.model_id, access_scope="everyone").result()  # type: ignore[arg-type]
    with pytest.raises(tinker.BadRequestError, match="project_id"):
        rest.list_training_runs(project_id="p").result()
    with pytest.raises(tinker.BadRequestError, match="checkpoint_id"):
        rest.delete_checkpoint(tc.model_id, "states/x").result()
    path = tc.save_state("kept").result().path
    with pytest.raises(tinker.BadRequestError, match=r"set_checkpoint_ttl\.ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(path, 0).result()
    # A name longer than a folder name may be: a user error, never a server error (the OS refuses the path).
    long = "x" * 300
    with pytest.raises(tinker.BadRequestError, match="at most 255 bytes"):
        rest.delete_checkpoint(tc.model_id, f"weights/{long}").result()
    with pytest.raises(tinker.BadRequestError, match="at most 255 bytes"):
        rest.set_checkpoint_ttl_from_tinker_path(f"tinker://{tc.model_id}/weights/{long}", 60).result()
    with pytest.raises(tinker.RequestFailedError, match="at most 255 bytes"):
        tc.save_state(long).result()


def test_what_is_not_served_is_refused_by_name(service_client, rest):
    path = training_client(service_client).save_state("kept").result().path
    for call, name in (
        (lambda: rest.publish_checkpoint_from_tinker_path(path), "publish_checkpoint_from_tinker_path"),
        (lambda: rest.unpublish_checkpoint_from_tinker_path(path), "unpublish_checkpoint_from_tinker_path"),
        (lambda: rest.copy_weights(path, "project"), "copy_weights"),
        (lambda: rest.list_sessions(), "list_sessions"),
    ):
        with pytest.raises(tinker.BadRequestError, match=name):
            call().result()


def test_tinker_paths_never_reach_outside_the_run(service_client, rest, out):
    tc = training_client(service_client)
    victim = tc.save_state("victim").result().path
    outside = out.parent / "outside"
    (outside / "weights" / "x").mkdir(parents=True)
    (outside / "weights" / "x" / "state.json").write_text("{}")
    run = tc.model_id
    # a link inside the run's weights folder to a checkpoint-looking folder outside it
    (run_folder(out, run) / "weights" / "link").symlink_to(outside / "weights" / "x")
    for path in (
        f"tinker://{run}/weights/..",
        f"tinker://{run}/weights/%2E%2E",
        f"tinker://{run}/weights/..%2F..%2Foutside%2Fweights%2Fx",
        f"tinker://{run}/weights/link",
        "tinker://../weights/victim",
        "tinker://%2E%2E/weights/outside",
        f"tinker://{run}%2F..%2F..%2Foutside/weights/x",
    ):
        with pytest.raises(tinker.APIStatusError) as refused:
            rest.delete_checkpoint_from_tinker_path(path).result()
        assert refused.value.status_code in (400, 404, 405), path
    assert (outside / "weights" / "x" / "state.json").exists()
    assert "weights/victim" in listed(rest, run)
    assert "weights/link" not in listed(rest, run)  # a link is never taken for a checkpoint
    assert victim.endswith("/weights/victim")


def test_the_catalog_refuses_names_that_are_not_plain(tmp_path):
    catalog = Catalog(tmp_path)
    catalog.open_run("r", tmp_path / "r", "tiny", {"rank": 1}, None)
    for checkpoint_id in ("weights/..", "weights/../r", "weights/.hidden", "sampler_weights/", "weights/a/b"):
        with pytest.raises(UserError, match="plain name"):
            catalog.checkpoint_folder("r", checkpoint_id)
    with pytest.raises(NotFound):
        catalog.checkpoint_folder("../r", "weights/a")


def test_runs_checkpoints_and_expiries_survive_a_restart(tmp_path, quick_reaper):
    from trainer.service.policies import MultiLora

    out = tmp_path / "out"
    with serve(out, MultiLora(make_cfg(tmp_path))) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = training_client(sc, renderer_name="qwen3")
        kept = tc.save_state("kept", user_metadata={"k": "v"}).result().path
        tc.save_weights_for_sampler("brief", ttl_seconds=1).result()
        run_id = tc.model_id
    time.sleep(1.2)  # "brief" expires while the service is down
    assert (run_folder(out, run_id) / "sampler_weights" / "brief").is_dir()
    with serve(out, MultiLora(make_cfg(tmp_path))) as url:  # a new process's model: its adapters start at m0
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        run = rest.get_training_run_by_tinker_path(kept).result()
        assert run.user_metadata == {"renderer_name": "qwen3"}
        wait_until(lambda: set(listed(rest, run_id)) == {"weights/kept"})
        assert listed(rest, run_id)["weights/kept"].user_metadata == {"k": "v"}
        assert not (run_folder(out, run_id) / "sampler_weights" / "brief").exists()
        # the new service's sessions do not reuse the old one's run ids
        new = training_client(tinker.ServiceClient(base_url=url, api_key=KEY))
        assert new.model_id != run_id
        assert {r.training_run_id for r in rest.list_training_runs().result().training_runs} == {
            run_id,
            new.model_id,
        }


def test_session_ids_cannot_be_guessed_from_ones_own(url):
    import httpx

    def opened() -> str:
        answer = httpx.post(f"{url}/api/v1/create_session", json={}, headers={"X-API-Key": KEY}, timeout=10)
        return str(answer.json()["session_id"])

    ids = [opened() for _ in range(3)]
    suffixes = [i.rsplit("-", 1)[1] for i in ids]
    assert len(set(ids)) == 3 and all(len(s) == 16 for s in suffixes)
    assert not any(s.isdigit() and len(s) < 8 for s in suffixes)  # no counter a client could step through


def test_external_weights_are_a_peft_folder_downloaded_through_signed_urls(service_client, rest, tmp_path):
    """save_weights_external then get_external_weights_urls, as hosted Tinker serves them: one URL per file, which
    needs no API key and downloads the client's adapter as a PEFT folder; listed and deleted like any checkpoint.
    A tampered or foreign signature is refused; a name that exists already is a user error."""
    import httpx
    from safetensors.torch import load_file

    tc = training_client(service_client)
    saved = tc.save_weights_external("final").result()
    assert saved.path == f"tinker://{tc.model_id}/external_weights/final"
    answer = rest.get_external_weights_urls(saved.path).result()
    assert sorted(answer.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    for rel, link in answer.urls.items():
        got = httpx.get(link)  # no X-API-Key: the URL is the credential
        assert got.status_code == 200, got.text
        (tmp_path / rel).write_bytes(got.content)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)

    link = answer.urls["adapter_config.json"]
    for bad in (link[:-4] + "0000", link.replace("adapter_config.json", "adapter_model.safetensors")):
        assert httpx.get(bad).status_code == 403
    with pytest.raises(tinker.RequestFailedError, match="exist already"):
        tc.save_weights_external("final").result()
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.checkpoint_type for c in listed if c.checkpoint_id == "external_weights/final"] == ["external"]
    rest.delete_checkpoint(tc.model_id, "external_weights/final").result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(saved.path).result()
