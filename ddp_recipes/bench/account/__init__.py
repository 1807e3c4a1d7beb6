"""Only ``report``, a transitional import path (see there); remove the folder once loader.py imports from cli."""
