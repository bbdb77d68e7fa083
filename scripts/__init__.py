"""Command-line tools around the recipe, run from the repository root as modules:
`python -m scripts.compare_runs`, `python -m scripts.convert_checkpoint`, ... (launcher.py and
launch_plan.py are the sbatch's, run by path on the batch host's own python3)."""
