// Command testserver is the whole of the image the real-node tests run (tests/cluster/test_real_node.py):
// an HTTP server with a readiness endpoint, and the client side the tests exec inside pods.
//
//	testserver serve [-port 8080] [-ready-after 0s]   serve / (who answers), /healthz (ready or 503)
//	testserver get URL [-ca FILE] [-token-file FILE]   GET, print the body; non-zero exit unless 2xx
//	testserver lookup NAME                             resolve through the pod's /etc/resolv.conf
//	testserver hog -mib N                              allocate and touch N MiB, then hold them
//
// Standard library only and built with CGO_ENABLED=0, so the image is this one file.
package main

import (
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2:])
	case "get":
		err = get(os.Args[2:])
	case "lookup":
		err = lookup(os.Args[2:])
	case "hog":
		err = hog(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "testserver %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: testserver serve|get|lookup|hog [flags] (see the source's header)")
	os.Exit(2)
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	port := fs.Int("port", 8080, "TCP port to listen on, all addresses")
	readyAfter := fs.Duration("ready-after", 0, "answer /healthz with 503 until this long after start")
	_ = fs.Parse(args)

	started := time.Now()
	var requests atomic.Int64
	host, _ := os.Hostname()
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if time.Since(started) < *readyAfter {
			http.Error(w, "starting", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		n := requests.Add(1)
		// One line per request on stdout: what `kubectl logs` shows.
		fmt.Printf("request %d: %s %s from %s\n", n, r.Method, r.URL.Path, r.RemoteAddr)
		fmt.Fprintf(w, "hello from %s\n", host)
	})
	listener, err := net.Listen("tcp", fmt.Sprintf(":%d", *port))
	if err != nil {
		return err
	}
	fmt.Printf("serving on %s as %s\n", listener.Addr(), host)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	server := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-stop
		fmt.Println("stopping")
		_ = server.Close()
	}()
	if err := server.Serve(listener); err != http.ErrServerClosed {
		return err
	}
	return nil
}

func get(args []string) error {
	fs := flag.NewFlagSet("get", flag.ExitOnError)
	caFile := fs.String("ca", "", "PEM bundle that must have signed the server's certificate")
	tokenFile := fs.String("token-file", "", "file holding a bearer token to send")
	timeout := fs.Duration("timeout", 10*time.Second, "whole-request timeout")
	_ = fs.Parse(args)
	if fs.NArg() != 1 {
		return fmt.Errorf("expected one URL, got %d arguments", fs.NArg())
	}
	transport := &http.Transport{Proxy: nil}
	if *caFile != "" {
		pem, err := os.ReadFile(*caFile)
		if err != nil {
			return err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("%s: no PEM certificate in it", *caFile)
		}
		// Verification stays on: the server's name must be in its certificate, signed by this CA.
		transport.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	req, err := http.NewRequest(http.MethodGet, fs.Arg(0), nil)
	if err != nil {
		return err
	}
	if *tokenFile != "" {
		token, err := os.ReadFile(*tokenFile)
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	}
	resp, err := (&http.Client{Transport: transport, Timeout: *timeout}).Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	os.Stdout.Write(body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s answered %s", fs.Arg(0), resp.Status)
	}
	return nil
}

func lookup(args []string) error {
	if len(args) != 1 {
		return fmt.Errorf("expected one name, got %d arguments", len(args))
	}
	addrs, err := net.LookupHost(args[0])
	if err != nil {
		return err
	}
	for _, a := range addrs {
		fmt.Println(a)
	}
	return nil
}

func hog(args []string) error {
	fs := flag.NewFlagSet("hog", flag.ExitOnError)
	mib := fs.Int("mib", 256, "MiB to allocate and touch")
	_ = fs.Parse(args)
	held := make([][]byte, 0, *mib)
	for i := 0; i < *mib; i++ {
		chunk := make([]byte, 1<<20)
		for j := 0; j < len(chunk); j += 4096 {
			chunk[j] = 1 // touch every page so it is really resident
		}
		held = append(held, chunk)
		if (i+1)%64 == 0 {
			fmt.Printf("holding %d MiB\n", i+1)
		}
	}
	fmt.Printf("holding %d MiB; sleeping\n", len(held))
	for {
		time.Sleep(time.Hour)
		runtime.KeepAlive(held)
	}
}
