"""The worker: runs text-to-video tasks from the durable JetStream consumers under leases."""
