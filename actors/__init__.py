"""Long-lived Trio tasks that own mutable state and talk over memory channels."""
