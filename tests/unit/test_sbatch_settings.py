"""1.train_llama.sbatch's settings read without running it: GPUs per node come from the
allocation, never a hard-coded 8. The sbatch on real Slurm is tests/integration/test_slurm_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import launcher

REPO = Path(__file__).resolve().parents[2]


def test_gpus_per_node_are_detected_not_hard_coded() -> None:
    def nvidia_smi(listing):
        return lambda: listing  # None: nvidia-smi failed (installed, but no driver)

    assert launcher.detect_gpus({"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0"}) == 4
    assert launcher.detect_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2"}, nvidia_smi(None)) == 3
    assert launcher.detect_gpus({}, nvidia_smi(None)) == 0  # CPU
    gpu_list = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})\n" for i in range(8))
    assert launcher.detect_gpus({}, nvidia_smi(gpu_list)) == 8
