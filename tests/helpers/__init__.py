"""What more than one test module uses, one module per concern; test modules import it as
``from helpers.X import ...`` (pytest puts tests/ on the import path: pyproject.toml) and never
import each other. Fixtures stay in tests/conftest.py; the TE test double is tests/te_double.

    procs.py               free ports, torchrun commands, ranks in processes, signals, a
                           script's refusal line
    runs.py                train.py's shared arguments (SMALL_LLAMA, FAST) and train.py in a
                           subprocess (run_train, its metrics.jsonl records and losses)
    inprocess.py           models in this process: a plain HF Llama, the model train.py builds
                           (build_tiny) and its whole training state (Run), in a world of one
    checkpoints.py         real checkpoints of a plain model or a small Llama, nested states
                           compared, scripts/convert_checkpoint.py's refusal line
    optimizers.py          AdamW's betas, parameter groups by decay, torchao's low-bit states
    te_models.py           small models on the TE test double and the TE backend's flags
    te_usages.py           where our code uses Transformer Engine (the TE contract's input)
    tensorboard_events.py  a run's TensorBoard events, read back
    slurm.py               real Slurm clusters, jobs, and the checks the Slurm and container
                           end-to-end tests share
    cudnn_standins.py      small shared libraries laid out like cuDNN
"""
