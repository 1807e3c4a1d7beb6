"""ddp-recipes."""
