"""Python modules generated from api.proto (scripts/gen_k8s_proto.sh); do not edit them."""
