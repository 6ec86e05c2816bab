// Command etcd is the upstream etcd server; it only forwards to etcdmain so that the
// server can be built from a pinned module version without the etcd repository.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
