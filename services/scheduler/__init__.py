"""The scheduler: scans that move stuck tasks on, and the TaskAdmin API."""
