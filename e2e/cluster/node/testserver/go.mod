// The real node's test image: one static binary, standard library only (see main.go).
module sovereign.ai/e2e/cluster/node/testserver

go 1.26.0
