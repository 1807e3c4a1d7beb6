"""The configuration: choice lists, the world (devices, nodes, accelerator, precision), the run config, the CLI
generated from it, and the resolved plan."""
