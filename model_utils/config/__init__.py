"""The config stage: flags, presets, recipes, the rules between flags and the resolved run
config."""
