"""Generated gRPC/protobuf stubs of the echospec.v1 package (see scripts/gen_protos.py)."""
