"""The commands a user runs, as modules from the repository root (`python -m scripts.demo`, ...);
launcher.py and launch_plan.py are the sbatch's, run by path on the batch host's own python3."""
