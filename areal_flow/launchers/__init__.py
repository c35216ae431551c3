"""Starting and watching the processes of a run (local subprocesses; clusters later)."""
