"""What test modules share (they import nothing else of tests/): the harness, factories, the webhook receiver."""
