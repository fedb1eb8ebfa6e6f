"""Protocol version 1: the REST API's request and response bodies."""

API_PREFIX = "/api/v1"
