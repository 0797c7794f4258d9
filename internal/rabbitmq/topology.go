// Package rabbitmq is Conveyor's RabbitMQ adapter: the topology of SPEC 5,
// the relay's confirming publisher and the worker's consumers. amqp091 types
// do not leave this package.
package rabbitmq

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The names of SPEC 5.
const (
	// TasksExchange routes task.run messages to their type's queue.
	TasksExchange = "conveyor.tasks"
	// ControlExchange broadcasts task.cancel messages to every worker.
	ControlExchange = "conveyor.control"
	// MaxPriority is the x-max-priority of every task queue.
	MaxPriority = 9
)

// QueueName is the durable queue that holds the task.run messages of a type.
func QueueName(taskType string) string { return "conveyor.task." + taskType }

// DeclareExchanges declares both exchanges, durable. Declaring is idempotent.
func DeclareExchanges(ch *amqp.Channel) error {
	if err := ch.ExchangeDeclare(TasksExchange, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %s: %w", TasksExchange, err)
	}
	if err := ch.ExchangeDeclare(ControlExchange, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %s: %w", ControlExchange, err)
	}
	return nil
}

// DeclareTaskQueue declares a type's durable priority queue and binds it to
// the tasks exchange with the type as routing key. Whoever first needs the
// queue declares it (relay before publishing, worker before consuming), so a
// task submitted before any worker exists waits in its queue.
func DeclareTaskQueue(ch *amqp.Channel, taskType string) error {
	q := QueueName(taskType)
	if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-max-priority": int32(MaxPriority)}); err != nil {
		return fmt.Errorf("declare queue %s: %w", q, err)
	}
	if err := ch.QueueBind(q, taskType, TasksExchange, false, nil); err != nil {
		return fmt.Errorf("bind queue %s: %w", q, err)
	}
	return nil
}
