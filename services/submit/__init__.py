"""The submit service: the TaskGateway API that internal backends call."""
