// fakegpu: a kubelet device plugin that advertises devices which do not exist, for kind clusters on
// machines without GPUs or RDMA NICs. Each -resource (e.g. nvidia.com/gpu=8) is registered with the
// kubelet as its own plugin, so pods that request it schedule and start (with NVIDIA_VISIBLE_DEVICES
// naming the fake ids); nothing is mounted and no driver is involved. The node's GPU labels, as NVIDIA's
// GPU operator sets them, are applied by the DaemonSet's manifest (e2e/kind/local/fakegpu.yaml).
//
// The kubelet removes every plugin socket when it restarts; each plugin then serves and registers again.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type resources []resource

type resource struct {
	name  string
	count int
}

func (r *resources) String() string { return fmt.Sprint(*r) }

func (r *resources) Set(value string) error {
	name, count, ok := strings.Cut(value, "=")
	n, err := strconv.Atoi(count)
	if !ok || name == "" || !strings.Contains(name, "/") || err != nil || n < 1 {
		return fmt.Errorf("want vendor-domain/resource=COUNT (COUNT >= 1), got %q", value)
	}
	*r = append(*r, resource{name, n})
	return nil
}

// plugin serves one extended resource of `count` healthy fake devices.
type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	resource resource
	socket   string
}

func (p *plugin) devices() []*pluginapi.Device {
	out := make([]*pluginapi.Device, p.resource.count)
	for i := range out {
		out[i] = &pluginapi.Device{ID: fmt.Sprintf("fake-%d", i), Health: pluginapi.Healthy}
	}
	return out
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices()}); err != nil {
		return err
	}
	<-stream.Context().Done() // the devices never change
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		envs := map[string]string{}
		if p.resource.name == "nvidia.com/gpu" {
			envs["NVIDIA_VISIBLE_DEVICES"] = strings.Join(c.DevicesIds, ",")
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{Envs: envs})
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// serve listens on the plugin's socket and registers with the kubelet; it returns when the socket is
// gone (the kubelet restarted) or ctx ends.
func (p *plugin) serve(ctx context.Context, dir string) error {
	path := filepath.Join(dir, p.socket)
	_ = os.Remove(path)
	listener, err := net.Listen("unix", path)
	if err != nil {
		return err
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(listener) }()
	defer server.Stop()

	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	registerCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(registerCtx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     p.socket,
		ResourceName: p.resource.name,
		Options:      &pluginapi.DevicePluginOptions{},
	})
	if err != nil {
		return fmt.Errorf("register %s: %w", p.resource.name, err)
	}
	log.Printf("registered %s: %d devices", p.resource.name, p.resource.count)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(2 * time.Second):
			if _, err := os.Stat(path); err != nil {
				log.Printf("%s: socket gone (kubelet restarted); registering again", p.resource.name)
				return nil
			}
		}
	}
}

func main() {
	var rs resources
	dir := flag.String("plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device plugin directory")
	flag.Var(&rs, "resource", "an extended resource and how many fake devices of it, e.g. nvidia.com/gpu=8 (repeatable)")
	flag.Parse()
	if len(rs) == 0 {
		log.Fatal("no -resource given")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	done := make(chan struct{}, len(rs))
	for i, r := range rs {
		p := &plugin{resource: r, socket: fmt.Sprintf("fakegpu-%d.sock", i)}
		go func() {
			defer func() { done <- struct{}{} }()
			for ctx.Err() == nil {
				if err := p.serve(ctx, *dir); err != nil {
					log.Printf("%s: %v; retrying in 5 s", r.name, err)
					select {
					case <-ctx.Done():
					case <-time.After(5 * time.Second):
					}
				}
			}
		}()
	}
	for range rs {
		<-done
	}
}
