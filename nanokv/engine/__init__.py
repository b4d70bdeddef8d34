"""The control plane: LLM (offline API), Engine (step API), Scheduler, Sequence."""
