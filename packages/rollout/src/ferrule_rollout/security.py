"""The rollout server's names for ferrule-grpc-auth's settings (see that package), apart from
the server so that the CLI can name them without importing gRPC."""

TOKEN_ENV = "FERRULE_ROLLOUT_TOKEN"
"""Where the server and its clients read the bearer token when no --token-file is given."""
