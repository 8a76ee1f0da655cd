"""The supervisor: owns config, sessions, the store, the control API and the children."""
