"""Train Llama with FSDP2 in BF16 or FP8, on one CPU or on a Slurm cluster of H100s.

    python train.py --preset tiny --max_steps 50 --fp8=1                  # laptop, emulated FP8
    torchrun --nproc_per_node=8 train.py --preset llama3-8b --fp8=1       # one node
    sbatch 1.train_llama.sbatch --preset llama2-7b --fp8=1                # a cluster

The recipe, top to bottom: check the flags, start the process group, build Llama on the meta
device, hand it to the precision backend (module swaps), shard it with FSDP2, materialise and
initialise each rank's shard, then train: data -> forward (under the backend's autocast) -> loss
-> backward -> clip -> AdamW -> LR schedule -> backend bookkeeping -> metrics -> checkpoints.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

import te_llama
from model_utils import checkpoint, data, optim
from model_utils.config import arguments
from model_utils.config.fp8_plan import plan_of
from model_utils.config.options import TE_IMPLS
from model_utils.config.run_config import Config
from model_utils.errors import Refusal, exit_refused
from model_utils.model import modeling
from model_utils.parallel import distributed, preflight
from model_utils.precision import backends as precision
from model_utils.precision import master_weights
from model_utils.report.run_log import RunLog
from model_utils.run import guards, outputs, run_lock, watchdog
from model_utils.run.profiling import RunProfiler
from model_utils.run.step import StepParts, train_step

log = logging.getLogger("train")


def validate(argv: list[str] | None, *, training: bool = True) -> tuple[Config, object]:
    """Every check that can fail on bad input, before any process group or file exists
    (``training=False``: the checks of a forward-only use, e.g. the GPU benchmark's rows)."""
    config = distributed.resolve_global_batch(arguments.parse_args(argv))  # for these ranks
    source, ckpt = config.data, config.checkpoint
    data.check_dataset(source.dataset, source.dataset_config_name)
    data.check_local_data(source.dataset, source.text_column)  # empty, corrupt, not UTF-8
    data.check_hub_dataset(source.dataset)  # a name that is no local path: one quick look-up
    tokenizer = data.load_tokenizer(source.tokenizer)
    data.check_vocab(tokenizer, config.model.vocab_size)
    if config.run.validate_only and os.path.exists(os.path.expanduser(source.dataset)):
        world = distributed.world_from_env()  # too little held-out text: here, not at start-up
        seq, batches = config.model.max_context_width, config.run.validation_batches
        data.validation_batches(source, tokenizer, seq, batches, world_size=world.world_size)
    config = config.replace(
        tokenizer_sha256=data.tokenizer_fingerprint(tokenizer),
        data_fingerprint=data.data_fingerprint(source.dataset, source.verify_data == "full"),
    )
    checkpoint.check_resume_arg(ckpt.resume_from_checkpoint)
    if ckpt.init_from_hf:
        checkpoint.check_hf_dir(ckpt.init_from_hf, config.model)  # the shape and RoPE too
    if ckpt.export_hf:
        checkpoint.check_export_dir(ckpt.export_hf, ckpt.checkpoint_dir)  # nor is pruned
    if config.precision.model_impl in TE_IMPLS:
        from model_utils.precision.te import check_requirements

        check_requirements(config, training=training)
    if training:  # a live run here, an output it cannot write, the resume policy (reads only)
        locks = run_lock.lock_dirs(config.run.output_dir, ckpt.checkpoint_dir)
        run_lock.check_not_locked(locks.values())
        locations = {**outputs.output_locations(config), **data.cache_location()}
        outputs.check_locations(locations, source.dataset, probe=config.run.validate_only)
        checkpoint.check_before_start(config)  # checkpoint/resume.py
    return config, tokenizer


class Preemption:
    """SIGUSR1/SIGTERM (Slurm's warning before the time limit) and SIGINT (Ctrl-C) ask for a
    checkpoint at the next step boundary, then a clean exit; the flag is reduced over ranks so
    every rank stops at the same step. (kill -9 stops at once; the newest checkpoint stays.)"""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def stand_down(self) -> None:
        """Ignore these signals from here to the exit: the run has saved what it will save. At
        interpreter shutdown CPython puts a Python handler back to the default action (death by
        the signal) but keeps an ignore, and the launcher resends a pending request every few
        seconds until torchrun exits: one landing then would turn a clean exit into status -10."""
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def build_model(config: Config, mesh, device, backend) -> torch.nn.Module:
    """Meta-device Llama -> precision swaps -> AC/compile -> FSDP2 -> initialised local shard."""
    built = modeling.build(
        config,
        config.precision.model_impl,
        device,
        fp8_recipe=backend.te_recipe,
        build_te=te_llama.build_te_llama,
    )
    model = backend.prepare(built)
    parallel = config.parallel
    if parallel.activation_checkpointing:
        distributed.apply_activation_checkpointing(
            model, backend.checkpoint_fn, parallel.ac_every, parallel.ac_scope
        )
    if parallel.compile:
        distributed.apply_compile(model)
    model = distributed.shard(model, mesh, parallel, bf16=config.precision.bf16)
    # --master_weights optimizer: keep the fp32 init on the host for the optimizer's masters
    modeling.materialize(model, device, config.run.seed, config.optim.master_weights == "optimizer")
    if config.checkpoint.init_from_hf:  # te: loaded through the model's state_dict_adapter
        checkpoint.load_hf_weights(model, config.checkpoint.init_from_hf)
    return model


def build_optimizer(model, config: Config, device, backend) -> tuple:
    """The optimizer (the backend's fused one where it has one) and LR schedule; with
    --master_weights optimizer its fp32 masters start from the fp32 init (or HF weights), not
    from the bf16/FP8 parameters."""
    optimizer, scheduler = optim.from_config(
        model, config.optim, config.run.max_steps, backend.master_weight_adam(device)
    )
    master_weights.seed_masters(optimizer)
    return optimizer, scheduler


@dataclass
class Run(StepParts):
    """The live run: one step's parts (model, optimizer, schedule, backend, flags, device) and
    what checks, saves and reports the steps: the loop, its stops and the run's end hand this
    one record to each other."""

    ckpt: checkpoint.Checkpointer
    state: checkpoint.TrainState
    guard: guards.StepGuard
    run_log: RunLog
    val_batches: list[dict[str, torch.Tensor]]


def build_run(config: Config, tokenizer, world: distributed.World, device) -> Run:
    """Everything the steps need, data first (its problems show before the model's cost), then
    the model, its outputs' room, the optimizer, and the run resumed or started."""
    torch.manual_seed(config.run.seed)
    mesh = distributed.build_mesh(world, device, config.parallel.sharding_strategy)
    if world.num_nodes > 1:  # every rank: its node and mesh groups (hybrid: replicas across)
        print(distributed.describe_rank(world, mesh), flush=True)
    backend = precision.build_backend(config, device, dp_group=dist.group.WORLD)

    stream = data.build_data(config, tokenizer, world)  # bad data before the model
    model = build_model(config, mesh, device, backend)
    outputs.check_outputs(config, world, modeling.count_parameters(model), log)  # before training
    optimizer, scheduler = build_optimizer(model, config, device, backend)
    log.info("optimizer: %s", optim.describe(optimizer))
    parts = StepParts(model, optimizer, scheduler, backend, config, device)
    return start_run(parts, stream, world)


def train(
    config: Config,
    tokenizer,
    world: distributed.World,
    device,
    preemption,
) -> None:
    """Build the run, then step until --max_steps or a stop request (a signal or a bad read:
    checkpoint, then exit)."""
    run = build_run(config, tokenizer, world, device)
    config, state, hang = run.config, run.state, run.run_log.watchdog  # config: as resumed
    model, backend, val_batches = run.model, run.backend, run.val_batches

    reads = data.ReadGuard(state.data, config.data.text_column, world.world_size)
    model.train()
    if config.parallel.cuda_graphs:  # after a resume: the graphs read the parameters in place
        te_llama.capture_cuda_graphs(
            model, backend, config.data.train_batch_size, config.model.max_context_width
        )
    run.run_log.meter.start()
    start_step, cool_from = state.step, plan_of(config).cooldown_from
    profiler = RunProfiler(config.run, world.rank, world.world_size, device, state.step)
    hang.start()
    try:
        with profiler:  # --profile_steps, --memory_snapshot_step; an OOM: one line
            while state.step < config.run.max_steps:
                cool_down_at(cool_from, run, first_step=start_step)
                done = train_step(run, reads.next, data_ok=reads.all_read)
                if not done.stepped:  # a bad read: the step is dropped, the last full one saved
                    with run.run_log.paused():
                        stop_on_bad_read(run, reads, world, start_step)
                state.step += 1
                run.guard.observe(state.step, done.loss, done.grad_norm)  # on the device, no sync
                run.run_log.step(state.step, done.loss, done.lr, done.data_wait, done.grad_norm)
                profiler.step(state.step)
                if config.run.validation_freq and state.step % config.run.validation_freq == 0:
                    run.run_log.validation(state.step, model, val_batches, backend)
                if step_boundary(run, stop_requested=preemption.requested):
                    with run.run_log.paused():
                        run.ckpt.save(state.step, state, block=True)
                    log.info("%s", preempted_line(config, state.step))
                    return
        hang.close()  # the last validation, save and export are not training steps
        finish(run, tokenizer, trained=state.step > start_step)
    except guards.Diverged as exc:  # here: the lr in the line is the one in use after a resume
        guards.exit_diverged(exc, config.optim.lr, world.is_main)
    finally:
        hang.close()
        run.run_log.close()  # a preempted or stopped run's trackers get what is queued


def cool_down_at(cool_from: int | None, run: Run, first_step: int) -> None:
    """At --bf16_cooldown's step (or a resume's first step past it): FP8 off to the end. A
    function of the step alone, so a resumed run switches where the uninterrupted one did."""
    if cool_from is None or run.state.step != max(cool_from, first_step):
        return
    run.backend.cool_down(run.model)
    step, last = run.state.step + 1, run.config.run.max_steps
    log.info("BF16 cool-down: steps %d-%d train with FP8 off (--bf16_cooldown)", step, last)


def stop_on_bad_read(run: Run, reads: data.ReadGuard, world, start_step: int) -> None:
    """A rank's read failed during the step just dropped: every rank saves the last full step
    (after the non-finite check every save gets; none if this launch trained no step, whose
    state is already saved or is the initial one), then raises the read's DataError."""
    step = run.state.step
    path = run.ckpt.latest()
    reads.rewind()
    if step > start_step:
        guards.check_step(run.guard, run.ckpt, step, run.model, stop_requested=True, saving=True)
        path = run.ckpt.save(step, run.state, block=True)
    data.raise_read_failure(reads.failure, world, step, path)


def step_boundary(run: Run, *, stop_requested: bool) -> bool:
    """At report and save steps only (an all-reduce + .item() every step would make the host
    wait for the device each step): whether every rank stops here, after the periodic save. A
    signal is acted on within --logging_freq steps; a non-finite step stops the run (guards.
    Diverged) before any checkpoint holds it."""
    step, every = run.state.step, run.config.checkpoint.checkpoint_freq
    save_now = every > 0 and step % every == 0
    if not (save_now or run.run_log.is_report_step(step)):
        return False
    stop = guards.check_step(
        run.guard, run.ckpt, step, run.model, stop_requested=stop_requested, saving=save_now
    )
    if save_now:
        with run.run_log.paused():
            run.ckpt.save(step, run.state)
    return stop


def start_run(parts: StepParts, stream: data.RankStream, world) -> Run:
    """The checkpointer and the state it saves, resumed if asked (the flags come back with the
    lr values a resume put in use, and the state saves them); then the run's report, started
    at the resumed step, with its --hang_timeout watchdog, and the non-finite guard."""
    config, model = parts.config, parts.model
    ckpt = checkpoint.Checkpointer(
        config.checkpoint.checkpoint_dir,
        config.checkpoint.keep_last,
        config.checkpoint.async_checkpoint,
        state_dict_adapter=te_llama.StateDictAdapter(model.config),  # loads of the other layout
    )
    state = checkpoint.TrainState(
        model,
        parts.optimizer,
        parts.scheduler,
        stream,
        config=config.as_dict(),
        fp8_recipe=parts.backend.te_recipe,
    )
    config = checkpoint.resume_or_start(ckpt, state, parts.scheduler, config)
    hang = watchdog.for_run(config.run, world.rank, parts.device)  # --hang_timeout
    with hang.watching("preflight collective"):  # a node that never answers: ends, named
        preflight.check(model, world, parts.device, config)
    run_log = RunLog(
        config,
        model,
        parts.backend,
        world,
        parts.device,
        start_step=state.step,
        watchdog=hang,
        seen=state.seen,  # counted on from the checkpoint's
    )
    return Run(
        **{**vars(parts), "config": config},
        ckpt=ckpt,
        state=state,
        guard=guards.StepGuard(parts.device),
        run_log=run_log,
        val_batches=stream.val_batches,  # the shards' read after a resume on fewer ranks
    )


def finish(run: Run, tokenizer, trained: bool) -> None:
    """The end of a run that reached --max_steps: last validation (unless recorded before a
    relaunch that `trained` no step: every rank agrees), last (finite) checkpoint, the HF
    export (with the run's tokenizer: a folder clients load whole), the summary."""
    config, ckpt, state, model = run.config, run.ckpt, run.state, run.model
    recorded = not trained and distributed.any_rank(run.run_log.validated_at(state.step))
    if not recorded and (not config.run.validation_freq or state.step % config.run.validation_freq):
        run.run_log.validation(state.step, model, run.val_batches, run.backend)
    # no non-finite save
    guards.check_step(run.guard, ckpt, state.step, model, stop_requested=False, saving=True)
    if config.checkpoint.checkpoint_freq >= 0:
        ckpt.save(state.step, state)  # a step saved just before is not written twice
    ckpt.close()
    if config.checkpoint.export_hf:
        masters = master_weights.masters_by_name(model, state.optimizer)  # fp32, if kept
        checkpoint.export_hf(
            model,
            model.config,
            config.checkpoint.export_hf,
            tokenizer,
            kept=ckpt.latest(),
            masters=masters,
        )
        log.info("Exported Hugging Face weights to %s", config.checkpoint.export_hf)
    run.run_log.finish()


def preempted_line(config: Config, step: int) -> str:
    """The stop's line: the step saved, and that --export_hf waits for the run's end (the resume
    writes it), so a preempted job's log does not read as if the weights were exported."""
    line = f"Preemption signal received: checkpoint saved at step {step}"
    if config.checkpoint.export_hf:
        export, end = config.checkpoint.export_hf, config.run.max_steps
        line += f"; --export_hf {export} is written when a resume ends at step {end}"
    return line


def ready_line(config: Config) -> str:
    """--validate_only's answer: the run as resolved (preset, precision and implementation,
    world, folder), so a launch can be checked before it costs a node."""
    plan = plan_of(config)
    precision = config.precision.name + (f" {plan.recipe.name}" if plan.on else "")
    world = os.environ.get("WORLD_SIZE", "set by torchrun")
    resume = config.checkpoint.resume_from_checkpoint or "none (a fresh start)"
    if resume == "auto":  # which one, before a requeue spends a node on it
        found = [p.name for p in checkpoint.complete_checkpoints(config.checkpoint.checkpoint_dir)]
        newest = f"newest complete: {found[-1]}, its checksums read at start" if found else ""
        resume += f" ({newest or 'none yet: a fresh start'})"
    recipe = f"--recipe {config.recipe}, " if config.recipe else ""
    folder = os.path.abspath(config.run.output_dir)
    return (
        f"train.py: ready: {recipe}{config.model_source}, {precision} on --model_impl "
        f"{config.precision.model_impl}, world {world}, run folder {folder}, resume {resume}"
    )


def configure_logging() -> None:
    """The upstream recipe's line format, its level letter included (a warning shows W, so
    grep finds every warning of a Slurm log by it)."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname).1s [%(filename)s:%(lineno)d] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stdout,
    )


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    preemption = Preemption()  # first: a signal during start-up must not kill the rank
    try:
        config, tokenizer = validate(argv)
    except Refusal as exc:  # before the ranks exist: every process says it
        exit_refused(exc)
    if config.run.validate_only:
        print(ready_line(config), flush=True)
        return
    world = distributed.world_from_env()
    if not world.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    device = distributed.device_for(world)
    if device.type == "cuda":  # NCCL's Flight Recorder, into the run folder (docs/hangs.md)
        watchdog.enable_flight_recorder(config.run.output_dir, world.rank)
    distributed.init(world, device, config.parallel.dist_timeout)
    locks: list[run_lock.RunLock] = []
    try:
        locks = run_lock.hold_run_dirs(config, world)
        train(config, tokenizer, world, device, preemption)
    except Refusal as exc:  # one line (rank 0's, or each rank's that ran out of memory)
        exit_refused(exc, is_main=world.is_main)
    finally:
        for lock in locks:
            lock.release()
        distributed.cleanup()
        preemption.stand_down()


if __name__ == "__main__":
    main()
