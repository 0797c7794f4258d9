// Command worker runs Conveyor's built-in task types (demo.sleep,
// demo.noop). Build your own worker binary with your handlers through
// package github.com/conveyorhq/conveyor/worker.
package main

import (
	"github.com/conveyorhq/conveyor/internal/demo"
	"github.com/conveyorhq/conveyor/worker"
)

func main() { worker.Main(demo.Handlers()...) }
