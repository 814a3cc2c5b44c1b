"""The generated gRPC code and typed stubs of the taskgate.v1 API (`make proto` writes them from protos/)."""
