"""What every pdserve service shares: the gRPC server shape, flags with env vars."""
