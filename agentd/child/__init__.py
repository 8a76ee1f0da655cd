"""The child process: runs the step-budgeted agent loop for its sessions (``python -m agentd.child``)."""
