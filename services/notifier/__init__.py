"""The notifier: relays task events to JetStream, sends signed webhooks from an outbox, and serves event streams."""
