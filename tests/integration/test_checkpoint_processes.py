"""Checkpoints across real processes: exact resume, keep-last, atomicity under a killed rank,
resharding 2 -> 1, FP8 <-> bf16 cross-loads, async save, Hugging Face round trips on sharded
ranks and the DCP -> HF converter.

This file is also the worker (`python tests/integration/test_checkpoint_processes.py SCENARIO
DIR`), run in real processes joined by a gloo process group, on the tiny Llama built by the
product's own modules (arguments -> modeling -> precision -> distributed). Each scenario writes
what it observed to DIR/<scenario>_rank<r>.json; the tests below assert on it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.checkpoints import TINY, differences, logits
from helpers.procs import PYTHON, free_port, rank_env

from model_utils import checkpoint as ck
from model_utils.checkpoint import layout
from model_utils.checkpoint.checkpointer import capture_rng, derived_seed, reseed_rng
from model_utils.checkpoint.hf import HF_INDEX, hf_weight_files
from model_utils.checkpoint.layout import weight_tensors
from model_utils.checkpoint.manifest import checkpoint_name, latest_checkpoint
from model_utils.data import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


WORKER_TIMEOUT_S = 240


# ============================================================================================
# Worker side (runs in the spawned processes)


class CounterStream:
    """A stand-in data stream whose per-rank state mixes ints, lists and a tensor that grows (so
    a fresh stream's state has another shape than the saved one), and whose batches also draw
    from the global torch RNG (so a resume is exact only if the RNG is restored too)."""

    def __init__(self, rank: int, vocab: int, micro_batch: int, seq: int) -> None:
        self.rank, self.vocab, self.micro_batch, self.seq = rank, vocab, micro_batch, seq
        self.position = 0
        self.history: list[int] = []
        self.seen = torch.zeros(0, dtype=torch.long)

    def __next__(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * self.rank + self.position)
        ids = torch.randint(0, self.vocab, (self.micro_batch, self.seq), generator=gen)
        ids[:, 0] = torch.randint(0, self.vocab, (self.micro_batch,))  # global RNG
        self.position += 1
        self.history.append(self.position * 10)
        self.seen = torch.cat([self.seen, ids[:, 0]])
        return {"input_ids": ids, "labels": ids.clone()}

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "history": list(self.history), "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]
        self.history = list(state["history"])
        self.seen = state["seen"].clone()

    def restart_after_reshard(self, saved_states: list[dict[str, Any]]) -> str:
        """A checkpoint of another world size: what every saved rank held, kept for the test."""
        self.resharded_from = [state["position"] for state in saved_states]
        return "the stream moved by the hook"


class Run:
    """One rank of a tiny-Llama training run built by the product's modules."""

    def __init__(
        self, workdir: Path, fp8: bool = False, all_gather: bool = False, hybrid: bool = False
    ) -> None:
        import train
        from model_utils import optim
        from model_utils.config import arguments
        from model_utils.parallel import distributed
        from model_utils.precision import backends as precision

        argv = [*TINY, "--output_dir", str(workdir), f"--fp8={int(fp8)}"]
        argv += [f"--fp8_all_gather={int(all_gather)}"]
        args = arguments.parse_args(argv)
        self.args = args
        self.world = distributed.world_from_env()
        self.device = torch.device("cpu")
        self.backend = precision.build_backend(args, self.device)
        mesh = MESH
        if hybrid:  # HSDP: replicate across the 2 ranks, shard within each (of size 1)
            mesh = distributed.build_mesh(self.world, self.device, "hybrid")
        self.model = train.build_model(args, mesh, self.device, self.backend)
        self.optimizer, self.scheduler = optim.from_config(
            self.model, args.optim, args.run.max_steps
        )
        self.stream = CounterStream(
            self.world.rank,
            args.model.vocab_size,
            args.data.train_batch_size,
            args.model.max_context_width,
        )
        self.state = ck.TrainState(
            self.model, self.optimizer, self.scheduler, self.stream, config=args.as_dict()
        )

    def train_step(self) -> float:
        """train.py's optimizer step; returns the loss averaged over ranks."""
        import torch.distributed as dist

        from model_utils.run.step import StepParts, train_step

        parts = StepParts(
            self.model, self.optimizer, self.scheduler, self.backend, self.args, self.device
        )
        done = train_step(parts, lambda: (next(self.stream), 1.0))
        self.state.step += 1
        total = done.loss.float().reshape(1)
        dist.all_reduce(total)
        return total.item() / dist.get_world_size()


def full_model(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: layout.unwrapped(v).detach().clone() for k, v in weight_tensors(sd).items()}


def full_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return _detach(sd)


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return layout.unwrapped(obj).detach().clone()
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_detach(v) for v in obj]
    return obj


def rng_snapshot() -> dict[str, Any]:
    state = capture_rng()
    return {"torch": state["torch"].clone(), "python": state["python"], "numpy": state["numpy"]}


def rng_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import numpy as np

    out = differences(a["torch"], b["torch"], "torch") + differences(a["python"], b["python"])
    na, nb = a["numpy"], b["numpy"]
    if not (na[0] == nb[0] and np.array_equal(na[1], nb[1]) and na[2:] == nb[2:]):
        out.append("numpy")
    return out


def scenario_train(workdir: Path, rank: int) -> dict[str, Any]:
    """2 ranks: init from sharded HF weights, save 3 checkpoints (keep_last=2), resume exactly,
    async save, FP8 <-> bf16 cross-loads, HF export."""
    from safetensors import safe_open

    out: dict[str, Any] = {}
    run = Run(workdir)
    ck.load_hf_weights(run.model, workdir / "hf_in")
    hf_files = hf_weight_files(workdir / "hf_in")
    reference = {}
    for name, f in hf_files.items():
        with safe_open(str(f), framework="pt") as fh:
            reference[name] = fh.get_tensor(name)
    out["init_from_hf_diff"] = differences(full_model(run.model), reference)

    ckpt = ck.Checkpointer(workdir / "ckpt", keep_last=2)
    out["losses"] = []
    for _ in range(3):
        out["losses"].append(run.train_step())
        ckpt.save(run.state.step, run.state)
    model3, optim3 = full_model(run.model), full_optimizer(run.model, run.optimizer)
    sched3, data3, rng3 = (
        run.scheduler.state_dict(),
        _detach(run.stream.state_dict()),
        rng_snapshot(),
    )
    if rank == 0:
        torch.save(
            {"model": model3, "optimizer": optim3, "scheduler": sched3},
            workdir / "snapshot_step3.pt",
        )
    out["listing"] = sorted(p.name for p in (workdir / "ckpt").iterdir())
    out["latest"] = ckpt.latest().name
    out["loss_step4"] = run.train_step()
    run.train_step()

    # A fresh process-like resume: new objects, auto-resolved checkpoint.
    fresh = Run(workdir)
    result = ck.Checkpointer(workdir / "ckpt", keep_last=2).load(ckpt.latest(), fresh.state)
    out["resume"] = {
        "step": fresh.state.step,
        "resharded": result.resharded,
        "saved_world_size": result.saved_world_size,
        "config_seed": result.saved_config.get("seed"),
    }
    out["resume_model_diff"] = differences(full_model(fresh.model), model3)
    out["resume_optim_diff"] = differences(full_optimizer(fresh.model, fresh.optimizer), optim3)
    out["resume_sched_diff"] = differences(fresh.scheduler.state_dict(), sched3)
    out["resume_data_diff"] = differences(_detach(fresh.stream.state_dict()), data3)
    out["resume_rng_diff"] = rng_differences(rng_snapshot(), rng3)
    out["resumed_loss_step4"] = fresh.train_step()

    # Async: the state is staged at save(); training on does not leak into the checkpoint.
    asyncer = ck.Checkpointer(workdir / "async", async_save=True)
    before = full_model(fresh.model)
    asyncer.save(fresh.state.step, fresh.state)
    fresh.train_step()
    asyncer.wait()
    out["async_listing"] = sorted(p.name for p in (workdir / "async").iterdir())
    probe = Run(workdir)
    asyncer.load(asyncer.latest(), probe.state)
    out["async_model_diff"] = differences(full_model(probe.model), before)
    out["async_step"] = probe.state.step
    asyncer.close()

    # bf16 checkpoint -> FP8 model (Float8Linear, float8 all-gather), then FP8 -> bf16.
    fp8 = Run(workdir, fp8=True, all_gather=True)
    out["fp8_linear_types"] = sorted(
        {type(m).__name__ for m in fp8.model.modules() if isinstance(m, torch.nn.Linear)}
    )
    ck.load_hf_weights(fp8.model, workdir / "hf_in")  # into Float8Linear + float8 all-gather
    out["fp8_init_from_hf_diff"] = differences(full_model(fp8.model), reference)
    ckpt.load(workdir / "ckpt" / checkpoint_name(3), fp8.state)
    out["bf16_to_fp8_model_diff"] = differences(full_model(fp8.model), model3)
    out["bf16_to_fp8_optim_diff"] = differences(full_optimizer(fp8.model, fp8.optimizer), optim3)
    out["fp8_loss_step4"] = fp8.train_step()
    fp8_ckpt = ck.Checkpointer(workdir / "fp8ck")
    fp8_ckpt.save(fp8.state.step, fp8.state)
    saved = ck.checkpointer.ModelItem(fp8.model).state_dict()  # what that save wrote
    out["fp8_saved_types"] = sorted(
        {type(getattr(v, "_local_tensor", v)).__name__ for v in saved.values()}
    )
    fp8_model, fp8_optim = full_model(fp8.model), full_optimizer(fp8.model, fp8.optimizer)
    back = Run(workdir)
    fp8_ckpt.load(fp8_ckpt.latest(), back.state)
    out["fp8_to_bf16_model_diff"] = differences(full_model(back.model), fp8_model)
    out["fp8_to_bf16_optim_diff"] = differences(
        full_optimizer(back.model, back.optimizer), fp8_optim
    )  # noqa: E501

    # HSDP (2-D mesh: replicate x shard) loads the FSDP checkpoint and HF weights alike.
    hsdp = Run(workdir, hybrid=True)
    out["hsdp_placements"] = str(next(hsdp.model.parameters()).placements)
    ckpt.load(workdir / "ckpt" / checkpoint_name(3), hsdp.state)
    out["hsdp_model_diff"] = differences(full_model(hsdp.model), model3)
    ck.load_hf_weights(hsdp.model, workdir / "hf_in")
    out["hsdp_init_from_hf_diff"] = differences(full_model(hsdp.model), reference)

    # HF export of the trained bf16 model, forced into several shards.
    tokenizer = load_tokenizer(fresh.args.data.tokenizer)
    ck.export_hf(
        fresh.model, fresh.model.config, workdir / "hf_out", tokenizer, max_shard_bytes=150_000
    )
    if rank == 0:
        torch.save(full_model(fresh.model), workdir / "export_reference.pt")
    else:
        full_model(fresh.model)  # collective: every rank takes part
    return out


def scenario_kill(workdir: Path, rank: int) -> dict[str, Any]:
    """2 ranks: checkpoint 1 completes; during checkpoint 2 rank 1 stalls inside DCP's write
    and the test SIGKILLs it from outside."""
    from torch.distributed.checkpoint import FileSystemWriter

    run = Run(workdir)
    ckpt = ck.Checkpointer(workdir / "killck")
    run.train_step()
    ckpt.save(1, run.state)
    if rank == 0:
        torch.save(full_model(run.model), workdir / "kill_snapshot_step1.pt")
    else:
        full_model(run.model)
    run.train_step()
    if rank == 1:
        real_write = FileSystemWriter.write_data

        def stalled_write(self, plan, planner):
            future = real_write(self, plan, planner)
            future.wait()  # this rank's shard file is (partly) on disk ...
            (workdir / "rank1_writing").touch()
            time.sleep(WORKER_TIMEOUT_S)  # ... and the test kills us here
            return future

        FileSystemWriter.write_data = stalled_write
    ckpt.save(2, run.state)
    return {"unexpected": "save 2 returned"}


def scenario_reshard(workdir: Path, rank: int) -> dict[str, Any]:
    """1 rank: load the 2-rank checkpoints (resharding), including the one whose successor was
    killed mid-save."""
    import logging

    out: dict[str, Any] = {}
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger(ck.__name__).addHandler(Collect())
    run = Run(workdir)
    ckpt = ck.Checkpointer(workdir / "ckpt")
    result = ckpt.load(ckpt.latest(), run.state)
    snap = torch.load(workdir / "snapshot_step3.pt", weights_only=False)
    out["result"] = {
        "step": result.step,
        "resharded": result.resharded,
        "saved_world_size": result.saved_world_size,
    }
    out["model_diff"] = differences(full_model(run.model), snap["model"])
    out["optim_diff"] = differences(full_optimizer(run.model, run.optimizer), snap["optimizer"])
    out["sched_diff"] = differences(run.scheduler.state_dict(), snap["scheduler"])
    out["hook_calls"] = run.state.data.resharded_from
    out["warned"] = any(
        "loaded on 1" in r and "reseeded" in r and "the stream moved by the hook" in r
        for r in records
    )
    drawn = torch.rand(4)
    reseed_rng(derived_seed(run.args.run.seed, 3, 0))
    out["rng_is_derived"] = torch.equal(drawn, torch.rand(4))
    out["loss_after_reshard"] = run.train_step()

    killed = ck.Checkpointer(workdir / "killck")  # cleans the dead save's temporary directory
    out["kill_listing_after_init"] = sorted(p.name for p in (workdir / "killck").iterdir())
    out["kill_latest"] = killed.latest().name
    probe = Run(workdir)
    killed.load(killed.latest(), probe.state)
    snap1 = torch.load(workdir / "kill_snapshot_step1.pt", weights_only=False)
    out["kill_model_diff"] = differences(full_model(probe.model), snap1)
    return out


SCENARIOS = {"train": scenario_train, "kill": scenario_kill, "reshard": scenario_reshard}
MESH = None


def worker_main(scenario: str, workdir: Path) -> None:
    global MESH
    from model_utils.parallel import distributed

    world = distributed.world_from_env()
    distributed.init(world, torch.device("cpu"), 60)
    MESH = distributed.build_mesh(world, torch.device("cpu"), "full")
    try:
        out = SCENARIOS[scenario](workdir, world.rank)
        (workdir / f"{scenario}_rank{world.rank}.json").write_text(json.dumps(out, indent=1))
    finally:
        distributed.cleanup()


# ============================================================================================
# Test side


def _launch(scenario: str, workdir: Path, world_size: int) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            **rank_env(rank, world_size, port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in ("", "tests")),
        }
        log = open(workdir / f"{scenario}_rank{rank}.log", "w")
        procs.append(
            subprocess.Popen(
                [PYTHON, __file__, scenario, str(workdir)],
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen], workdir: Path, scenario: str) -> list[dict]:
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    logs = "\n".join(
        (workdir / f"{scenario}_rank{r}.log").read_text()[-3000:] for r in range(len(procs))
    )  # noqa: E501
    assert all(p.returncode == 0 for p in procs), f"{scenario} failed:\n{logs}"
    return [
        json.loads((workdir / f"{scenario}_rank{r}.json").read_text()) for r in range(len(procs))
    ]  # noqa: E501


def _write_hf_input(workdir: Path) -> None:
    """A sharded HF checkpoint of the tiny shape, made by transformers itself."""
    from transformers import LlamaForCausalLM

    from model_utils.config import arguments
    from model_utils.model import modeling

    config = modeling.model_config(arguments.parse_args(TINY).model)
    torch.manual_seed(123)
    LlamaForCausalLM(config).save_pretrained(workdir / "hf_in", max_shard_size="100KB")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def train_run(workdir: Path) -> list[dict]:
    _write_hf_input(workdir)
    return _finish(_launch("train", workdir, 2), workdir, "train")


@pytest.fixture(scope="module")
def kill_run(workdir: Path, train_run: list[dict]) -> dict[str, Any]:
    """Rank 1 is SIGKILLed while it writes checkpoint 2; rank 0 then fails or is killed too."""
    procs = _launch("kill", workdir, 2)
    flag = workdir / "rank1_writing"
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while not flag.exists() and time.monotonic() < deadline and procs[1].poll() is None:
        time.sleep(0.1)
    assert flag.exists(), (workdir / "kill_rank1.log").read_text()[-3000:]
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    try:
        procs[0].wait(timeout=30)  # gloo sees the dead peer and raises
    except subprocess.TimeoutExpired:
        procs[0].kill()
        procs[0].wait()
    return {
        "returncodes": [p.returncode for p in procs],
        "listing": sorted(p.name for p in (workdir / "killck").iterdir()),
        "latest": latest_checkpoint(workdir / "killck"),
    }


@pytest.fixture(scope="module")
def reshard_run(workdir: Path, train_run: list[dict], kill_run: dict) -> dict[str, Any]:
    return _finish(_launch("reshard", workdir, 1), workdir, "reshard")[0]


# -- 2 ranks: save, resume, async, FP8, HF ------------------------------------------------------


@pytest.mark.slow
def test_init_from_sharded_hf_gives_each_rank_the_exact_weights(train_run: list[dict]) -> None:
    assert [r["init_from_hf_diff"] for r in train_run] == [[], []]
    assert [r["fp8_init_from_hf_diff"] for r in train_run] == [[], []]


@pytest.mark.slow
def test_hybrid_sharding_loads_checkpoints_and_hf_weights(train_run: list[dict]) -> None:
    for r in train_run:
        assert "Replicate" in r["hsdp_placements"] and "Shard" in r["hsdp_placements"]
        assert r["hsdp_model_diff"] == []
        assert r["hsdp_init_from_hf_diff"] == []


@pytest.mark.slow
def test_resume_restores_everything_exactly(train_run: list[dict]) -> None:
    for r in train_run:
        assert r["resume"] == {
            "step": 3,
            "resharded": False,
            "saved_world_size": 2,
            "config_seed": 7,
        }
        assert r["resume_model_diff"] == []
        assert r["resume_optim_diff"] == []
        assert r["resume_sched_diff"] == []
        assert r["resume_data_diff"] == []
        assert r["resume_rng_diff"] == []
        # Bit-identical next step: model, optimizer, schedule, data and RNG all came back.
        assert r["resumed_loss_step4"] == r["loss_step4"]


@pytest.mark.slow
def test_keep_last_prunes_after_publish(train_run: list[dict]) -> None:
    assert train_run[0]["listing"] == ["step_00000002", "step_00000003"]
    assert train_run[0]["latest"] == "step_00000003"


@pytest.mark.slow
def test_async_save_snapshots_state_at_save_time(train_run: list[dict]) -> None:
    for r in train_run:
        assert r["async_listing"] == ["step_00000004"]
        assert r["async_step"] == 4
        assert r["async_model_diff"] == []


@pytest.mark.slow
def test_fp8_and_bf16_checkpoints_load_into_each_other(train_run: list[dict]) -> None:
    for r in train_run:
        assert "Float8Linear" in r["fp8_linear_types"]
        assert r["fp8_saved_types"] == ["Tensor"]  # not torchao's all-gather wrapper, pickled
        assert r["bf16_to_fp8_model_diff"] == []
        assert r["bf16_to_fp8_optim_diff"] == []
        assert r["fp8_to_bf16_model_diff"] == []
        assert r["fp8_to_bf16_optim_diff"] == []
        assert math.isfinite(r["fp8_loss_step4"])
        assert abs(r["fp8_loss_step4"] - r["loss_step4"]) < 0.05  # same weights, FP8 numerics


@pytest.mark.slow
def test_export_hf_round_trip_has_identical_logits(workdir: Path, train_run: list[dict]) -> None:
    from transformers import LlamaForCausalLM

    out = workdir / "hf_out"
    assert (out / HF_INDEX).is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    exported = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = LlamaForCausalLM(exported.config)
    reference.load_state_dict(torch.load(workdir / "export_reference.pt"))
    assert torch.equal(logits(exported), logits(reference))


@pytest.mark.slow
def test_convert_script_writes_loadable_hf(workdir: Path, train_run: list[dict]) -> None:
    from transformers import LlamaForCausalLM

    out = workdir / "converted"
    cmd = [PYTHON, str(REPO / "scripts" / "convert_checkpoint.py")]
    done = subprocess.run([*cmd, str(workdir / "ckpt"), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "step 3" in done.stdout
    converted = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    snapshot = torch.load(workdir / "snapshot_step3.pt", weights_only=False)["model"]
    assert differences(dict(converted.state_dict()), snapshot) == []
    reference = LlamaForCausalLM(converted.config)
    reference.load_state_dict(snapshot)
    assert torch.equal(logits(converted), logits(reference))


# -- a rank killed mid-save; then 2 -> 1 resharding ------------------------------------------


@pytest.mark.slow
def test_killed_save_leaves_previous_checkpoint_latest(kill_run: dict) -> None:
    assert kill_run["returncodes"][1] == -signal.SIGKILL
    assert kill_run["returncodes"][0] != 0  # the survivor errors out (or is stopped), no hang
    assert kill_run["listing"] == [".tmp-step_00000002", "step_00000001"]
    assert kill_run["latest"].name == "step_00000001"


@pytest.mark.slow
def test_killed_save_is_cleaned_and_previous_loads(reshard_run: dict) -> None:
    assert reshard_run["kill_listing_after_init"] == ["step_00000001"]
    assert reshard_run["kill_latest"] == "step_00000001"
    assert reshard_run["kill_model_diff"] == []


@pytest.mark.slow
def test_two_rank_checkpoint_loads_on_one_rank(reshard_run: dict) -> None:
    assert reshard_run["result"] == {"step": 3, "resharded": True, "saved_world_size": 2}
    assert reshard_run["model_diff"] == []
    assert reshard_run["optim_diff"] == []
    assert reshard_run["sched_diff"] == []
    # The data stream gets every saved rank's position; RNGs are reseeded from (seed, step, rank).
    assert reshard_run["hook_calls"] == [3, 3]
    assert reshard_run["rng_is_derived"]
    assert reshard_run["warned"]
    assert math.isfinite(reshard_run["loss_after_reshard"])


if __name__ == "__main__":
    worker_main(sys.argv[1], Path(sys.argv[2]))
