"""The HTTP service: the TaskGateway and TaskEvents API as JSON and Server-Sent Events, and the operator dashboard."""
