// The pod sandbox ("pause") container of the test node: it holds the pod's namespaces
// and exits on SIGTERM/SIGINT. Built here because no registry (registry.k8s.io/pause)
// is reachable; the upstream one is C, this is the same loop in Go.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	// Reap children so a shared PID namespace never fills with zombies.
	signal.Ignore(syscall.SIGCHLD)
	<-sigs
}
