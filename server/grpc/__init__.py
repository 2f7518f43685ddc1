"""The gRPC frontend: Triton's GRPCInferenceService as a second client of the broker."""
