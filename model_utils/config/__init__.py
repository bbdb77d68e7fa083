"""The config stage: flags, presets, recipes, the rules between flags, the resolved run config."""
