"""The reward server's values for the settings that ferrule-grpc-auth takes (see that
package)."""

TOKEN_ENV = "FERRULE_REWARDS_TOKEN"
"""Where the server and its clients read the bearer token when no --token-file is given."""
NO_TOKEN_METHODS = ("/grpc.health.v1.Health/",)
"""Calls that need no token: load balancers and Kubernetes probes cannot send one, and the
answer reveals only SERVING or NOT_SERVING."""
