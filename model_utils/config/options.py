"""The values each flag takes: the choices of the command line, in one leaf module that the
flag parser, the rules between flags and the stages that act on a choice all read (so none of
them imports another to learn what a flag may say)."""

from __future__ import annotations

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: ``--fp8_recipe`` values for TE -> TE recipe class (``transformer_engine.common.recipe``).
TE_RECIPES: dict[str, str] = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "block": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
}
#: TE recipes with an FP8 attention path (``--fp8_attention``); current scaling's needs SM 10.0+.
FP8_ATTENTION_RECIPES = ("delayed", "current")
MODEL_IMPLS = ("auto", "hf", "te", "te_linear")
#: ``--reshard_after_forward``: which FSDP2 units free their gathered parameters after forward.
RESHARD_POLICIES = ("default", "never", "always")
#: What each checkpointed layer recomputes (``--ac_scope``): the whole decoder layer, or only
#: its MLP (for ``--model_impl te`` TE's own LayerNormMLP recompute, which skips fc2).
AC_SCOPES = ("layer", "mlp")
TE_IMPLS = ("te", "te_linear")  # the implementations that run on the TE precision backend
# adamw: torch's, fp32 moments; adamw8bit / adamw_fp8: torchao.optim's AdamW8bit / AdamWFp8.
OPTIMIZERS = ("adamw", "adamw8bit", "adamw_fp8")
#: Where the fp32 master weights live (``--master_weights``): in the parameters themselves (FSDP2
#: casts them to bf16 for compute), or in the optimizer beside bf16 parameters.
MASTER_WEIGHTS = ("params", "optimizer")
