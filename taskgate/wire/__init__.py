"""The messages services send each other over NATS, one module per message, each the only author of its own."""
