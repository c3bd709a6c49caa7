"""The reward server's values for the settings that ferrule-grpc-auth takes (see that
package)."""

TOKEN_ENV = "FERRULE_REWARDS_TOKEN"
"""The environment variable from which the server and its clients read the bearer token when
no --token-file is given."""
NO_TOKEN_METHODS = ("/grpc.health.v1.Health/",)
"""Prefixes of the methods whose calls need no token (the health service). Load balancers and
Kubernetes probes cannot send a token, and a health answer reveals only SERVING or
NOT_SERVING."""
