"""Models and training state built in this process: a plain HF Llama, and the model,
optimizer and schedule exactly as train.py builds them, in a world of one (gloo)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

import te_llama
from helpers.runs import FAST, SMALL_LLAMA
from model_utils import checkpoint as ck
from model_utils.checkpoint import hf
from model_utils.checkpoint.layout import param_layout, weight_tensors
from model_utils.model import te_support


def tiny_llama(**overrides: object) -> LlamaForCausalLM:
    config = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    config.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config))


# A small Llama (GQA, 2 layers) on the bundled corpus and tokenizer; shapes FP8 GEMMs accept.
SMALL = [*SMALL_LLAMA, *"--train_batch_size 2 --warmup 1 --validation_batches 1".split()]


def world_of_one() -> None:
    """This process as a gloo world of one (once: later calls find it initialised)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class Run:
    """Model, optimizer and schedule exactly as train.py builds them, in a world of one."""

    def __init__(
        self,
        impl: str,
        fp8: bool,
        seed: int,
        checkpoint_dir: Path,
        recipe: str = "delayed",
        flags: tuple[str, ...] = (),
    ) -> None:
        import train
        from model_utils import optim
        from model_utils.config.arguments import parse_args
        from model_utils.parallel import distributed
        from model_utils.precision import backends as precision

        # FP8 runs inside a bf16 model (train.py refuses --fp8=1 --bf16=0); others run in fp32.
        te_fp8 = ["--fp8=1", "--fp8_recipe", recipe]
        te_fp8 += ["--amax_history_len", "4"] if recipe == "delayed" else []
        extra = (
            [*(te_fp8 if impl != "hf" else ["--fp8=1"]), "--bf16=1"]
            if fp8
            else ["--fp8=0", "--bf16=0"]
        )
        self.compute_dtype = torch.bfloat16 if fp8 else torch.float32
        self.args = args = parse_args(
            [*SMALL, f"--model_impl={impl}", f"--seed={seed}", "--max_steps=8", *extra, *flags]
        )
        world_of_one()
        device = torch.device("cpu")
        mesh = distributed.build_mesh(distributed.world_from_env({}), device, "full")
        self.backend = precision.build_backend(args, device)
        self.model = train.build_model(args, mesh, device, self.backend)
        self.optimizer, self.scheduler = optim.from_config(
            self.model, args.optim, args.run.max_steps
        )
        self.state = ck.TrainState(
            self.model,
            self.optimizer,
            self.scheduler,
            config=args.as_dict(),
            fp8_recipe=self.backend.te_recipe,
        )
        adapter = te_llama.StateDictAdapter(self.model.config)
        self.checkpointer = ck.Checkpointer(checkpoint_dir, keep_last=0, state_dict_adapter=adapter)

    def step(self, seed: int) -> float:
        """train.py's step on one fixed micro-batch; returns its loss."""
        from model_utils.run.step import StepParts, train_step

        ids = batch(seed)
        parts = StepParts(
            self.model, self.optimizer, self.scheduler, self.backend, self.args, torch.device("cpu")
        )
        done = train_step(parts, lambda: ({"input_ids": ids, "labels": ids}, 1.0))
        self.state.step += 1
        return done.loss.item()

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights under HF names, whatever the layout."""
        full = {
            k: hf.full_cpu(v, torch.float32)
            for k, v in weight_tensors(get_model_state_dict(self.model)).items()
        }
        return to_hf(full, self.model.config)

    def hf_moments(self, field: str) -> dict[str, torch.Tensor]:
        osd = get_optimizer_state_dict(self.model, self.optimizer)
        full = {k: hf.full_cpu(v[field], torch.float32) for k, v in osd["state"].items()}
        return to_hf(full, self.model.config)

    def adam_steps(self) -> set[float]:
        osd = get_optimizer_state_dict(self.model, self.optimizer)
        return {v["step"].item() for v in osd["state"].values()}

    def extra_state_bytes(self) -> int:
        sd = get_model_state_dict(self.model)
        return sum(v.numel() for k, v in sd.items() if te_support.is_te_extra_state_key(k))


def to_hf(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    if param_layout(state) == "te":
        return te_llama.StateDictAdapter(config).to_hf(state)
    return state


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(seed))


def build_tiny(extra: list[str]):
    """The model train.py would build from FAST and ``extra``, in this process (a world of one)."""
    import train
    from model_utils.config.arguments import parse_args
    from model_utils.parallel import distributed
    from model_utils.precision import backends as precision

    args = parse_args([*FAST, "--max_steps=5", "--warmup=1", *extra])
    device = torch.device("cpu")
    world_of_one()
    world = distributed.world_from_env({})
    mesh = distributed.build_mesh(world, device, "full")
    backend = precision.build_backend(args, device)
    return train.build_model(args, mesh, device, backend)
