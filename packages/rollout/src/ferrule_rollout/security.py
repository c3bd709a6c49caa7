"""Names that the rollout server uses for its ferrule-grpc-auth settings (see that package).
They live apart from server.py so that the CLI can use them without importing gRPC."""

TOKEN_ENV = "FERRULE_ROLLOUT_TOKEN"
"""The environment variable that the server and its clients read the bearer token from when no
--token-file is given."""
