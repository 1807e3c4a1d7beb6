"""LightningModules: the models the recipes train."""
