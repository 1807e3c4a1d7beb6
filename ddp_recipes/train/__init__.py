"""The training run: the Trainer factory, fit/test around it, its callbacks, diagnostics and user classes."""
